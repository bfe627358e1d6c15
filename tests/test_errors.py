"""Bad input gets a clear exception naming the problem."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import NATIVE_OR_PYTHON

from prefixattn import PrefixAttention

TABLE = np.array([[0, 1, 2], [0, 1, 3]], dtype=np.int32)
LENS = np.array([9, 10], dtype=np.int32)  # page size 4: 3 pages each


def _pa(**kw) -> PrefixAttention:
    return PrefixAttention(8, 2, 64, 4, dtype=torch.float32, **kw)


def _inputs(num_pages: int = 4, tokens: int = 2):
    q = torch.randn(tokens, 8, 64)
    k = torch.randn(num_pages, 4, 2, 64)
    return q, k, torch.randn_like(k)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_qo_heads": 6, "num_kv_heads": 4}, "multiple of num_kv_heads"),
        ({"num_qo_heads": 34, "num_kv_heads": 2}, "group size 17"),
        ({"head_dim": 96}, "unsupported head_dim 96"),
        ({"page_size": 0}, "page_size must be a positive int"),
        ({"page_size": 256}, "page_size 256 is larger than 128"),
        ({"kv_layout": "NDH"}, "kv_layout"),
        ({"num_kv_heads": -1}, "num_kv_heads must be a positive int"),
    ],
)
def test_constructor_rejects(kwargs: dict, message: str) -> None:
    args = {"num_qo_heads": 8, "num_kv_heads": 2, "head_dim": 64, "page_size": 4} | kwargs
    with pytest.raises(ValueError, match=message):
        PrefixAttention(**args)


def test_constructor_rejects_dtype() -> None:
    with pytest.raises(TypeError, match="unsupported dtype"):
        PrefixAttention(8, 2, 64, 4, dtype=torch.int8)


@pytest.mark.parametrize(
    ("table", "lens", "qo_indptr", "error", "message"),
    [
        (TABLE[0], LENS, None, ValueError, "block_table must be 2-D"),
        (TABLE.astype(np.float32), LENS, None, TypeError, "block_table must be an integer"),
        (TABLE, LENS[:1], None, ValueError, "seq_lens has 1 entries but block_table has 2 rows"),
        (TABLE, np.array([9, -1]), None, ValueError, r"seq_lens\[1\] = -1 is negative"),
        (TABLE, np.array([9, 13]), None, ValueError, r"seq_lens\[1\] = 13 needs 4 pages"),
        (TABLE, LENS, np.array([0, 1]), ValueError, "qo_indptr must have B\\+1 = 3 entries"),
        (TABLE, LENS, np.array([1, 2, 3]), ValueError, "qo_indptr must start at 0"),
        (TABLE, LENS, np.array([0, 2, 1]), ValueError, "decreasing at request 1"),
        (TABLE, LENS, np.array([0, 10, 21]), ValueError, r"seq_lens must include the new tokens"),
        (np.array([[0, 1, 2], [0, -5, 3]]), LENS, None, IndexError, r"block_table\[1, 1\] = -5"),
        (TABLE, LENS, np.array([[0, 1, 2]]), ValueError, "qo_indptr must be 1-D"),
    ],
)
def test_plan_rejects(table, lens, qo_indptr, error, message) -> None:
    with pytest.raises(error, match=message):
        _pa().plan(table, lens, qo_indptr)


def test_plan_rejects_wrong_tensor_dtype_and_packing() -> None:
    with pytest.raises(TypeError, match="block_table must be an int32 tensor"):
        _pa().plan(torch.from_numpy(TABLE).float(), LENS)
    with pytest.raises(TypeError, match=r"seq_lens must be a torch\.Tensor or numpy array"):
        _pa().plan(TABLE, [9, 10])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown packing 'greedy'"):
        _pa().plan(TABLE, LENS, packing="greedy")


def test_junk_past_the_used_pages_is_ignored() -> None:
    table = np.array([[0, 1, -7], [0, 2, 99]], dtype=np.int32)
    plan = _pa().plan(table, np.array([8, 5]))
    assert plan.max_page_id == 2


def test_run_before_plan() -> None:
    with pytest.raises(RuntimeError, match="before plan"):
        _pa().run(*_inputs())


def test_run_rejects_page_ids_beyond_the_cache() -> None:
    pa = _pa()
    pa.plan(TABLE, LENS)
    with pytest.raises(IndexError, match="refers to page 3 but k_cache has only 3 pages"):
        pa.run(*_inputs(num_pages=3))


@pytest.mark.parametrize(
    ("mutate", "error", "message"),
    [
        (lambda q, k, v: (q.half(), k, v), TypeError, "q has dtype torch.float16"),
        (lambda q, k, v: (q, k.double(), v), TypeError, "k_cache has dtype torch.float64"),
        (lambda q, k, v: (q[0], k, v), ValueError, "q must be 3-D"),
        (
            lambda q, k, v: (q[:1], k, v),
            ValueError,
            r"q has shape \(1, 8, 64\), expected \(2, 8, 64\)",
        ),
        (lambda q, k, v: (q, k[0], v), ValueError, "k_cache must be 4-D"),
        (lambda q, k, v: (q, k[:, :2], v), ValueError, "page_size=4"),
        (lambda q, k, v: (q, k, v[:, :, :1]), ValueError, "num_kv_heads=2"),
        (lambda q, k, v: (q, k, v[:3]), ValueError, "k_cache has 4 pages but v_cache has 3"),
        (
            lambda q, k, v: (q.transpose(1, 2).contiguous().transpose(1, 2), k, v),
            ValueError,
            "q must have a contiguous last dimension",
        ),
        (
            lambda q, k, v: (q, k.transpose(2, 3).contiguous().transpose(2, 3), v),
            ValueError,
            "k_cache must have a contiguous last dimension",
        ),
        (lambda q, k, v: (q, k.to("meta"), v), ValueError, "k_cache is on meta but q is on cpu"),
        (lambda q, k, v: (q.to("meta"), k, v), ValueError, "q is on meta but the plan's arrays"),
        (lambda q, k, v: ("q", k, v), TypeError, "q must be a torch.Tensor"),
    ],
)
def test_run_rejects(mutate, error, message) -> None:
    pa = _pa()
    pa.plan(TABLE, LENS)
    with pytest.raises(error, match=message):
        pa.run(*mutate(*_inputs()))


def test_run_rejects_bad_out() -> None:
    pa = _pa()
    pa.plan(TABLE, LENS)
    q, k, v = _inputs()
    with pytest.raises(ValueError, match="out has shape"):
        pa.run(q, k, v, out=torch.empty(3, 8, 64))
    with pytest.raises(TypeError, match="out must match q's dtype"):
        pa.run(q, k, v, out=torch.empty(2, 8, 64, dtype=torch.float64))


def test_hnd_layout_shape_is_checked() -> None:
    pa = _pa(kv_layout="HND")
    pa.plan(TABLE, LENS)
    q, k, v = _inputs()  # NHD-shaped caches
    with pytest.raises(ValueError, match=r"\[num_pages, num_kv_heads, page_size, head_dim\]"):
        pa.run(q, k, v)


@pytest.mark.parametrize(
    ("target", "error"),
    [(-1, ValueError), (2**63, ValueError), (1.5, TypeError), ("132", TypeError)],
)
def test_bad_split_target_is_rejected_when_set(target: object, error: type[Exception]) -> None:
    pa = _pa()
    with pytest.raises(error, match=r"PlanOptions\.split_target must be"):
        pa.split_target = target  # type: ignore[assignment]
    assert pa.split_target is None  # unchanged


@pytest.mark.parametrize(
    ("table", "lens", "message"),
    [
        # int64/uint64 ids outside int32 must not wrap onto real pages.
        (
            np.array([[0, 1, 2], [0, -(2**32) + 7, 3]]),
            LENS,
            r"\[1, 1\] = -4294967289 is a negative",
        ),
        (
            np.array([[0, 1, 2], [0, 2**32 + 1, 3]]),
            LENS,
            r"\[1, 1\] = 4294967297 is a page id beyond int32",
        ),
        (
            np.array([[0, 1, 2], [0, 2**63 + 1, 3]], np.uint64),
            LENS,
            r"block_table\[1, 1\] = 9223372036854775809 is a page id beyond int32",
        ),
        (
            TABLE,
            np.array([9, 2**64 - 1], np.uint64),
            r"seq_lens\[1\] = 18446744073709551615 is out of range",
        ),
    ],
)
@pytest.mark.parametrize("native", NATIVE_OR_PYTHON)
def test_plan_rejects_ids_outside_int32(table, lens, message, native) -> None:
    pa = _pa()
    pa.native_plan = native
    with pytest.raises((IndexError, ValueError), match=message):
        pa.plan(table, lens)


def test_int64_padding_rows_may_hold_anything() -> None:
    # A row without new tokens is not read: -1 there is fine in any integer dtype.
    for dtype in (np.int32, np.int64):
        table = np.array([[0, 1], [-1, -1]], dtype=dtype)
        plan = _pa().plan(table, np.array([8, 8]), np.array([0, 1, 1]))
        assert plan.max_page_id == 1


@pytest.mark.parametrize("native", NATIVE_OR_PYTHON)
def test_plan_accepts_non_contiguous_tables(native: bool) -> None:
    pa = _pa()
    pa.native_plan = native
    want = pa.plan(TABLE, LENS)
    for table in (np.asfortranarray(TABLE), torch.from_numpy(TABLE.T.copy()).t()):
        got = pa.plan(table, LENS)
        assert np.array_equal(got.host.kv_pages, want.host.kv_pages)


def test_plan_rejects_other_bad_arguments() -> None:
    with pytest.raises(TypeError, match="split_kv must be a bool"):
        _pa().plan(TABLE, LENS, split_kv="no")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="block_table is a meta tensor"):
        _pa().plan(torch.from_numpy(TABLE).to("meta"), LENS)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_cuda_device_without_cuda() -> None:
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        _pa(device="cuda")


@pytest.mark.parametrize(
    ("other", "message"),
    [
        ({"page_size": 2}, "page_size 2 vs 4"),
        ({"kv_layout": "HND"}, "kv_layout 'HND' vs 'NHD'"),
        ({"num_qo_heads": 4}, "num_qo_heads 4 vs 8"),
    ],
)
def test_run_rejects_a_plan_of_another_geometry(other: dict, message: str) -> None:
    args = {
        "num_qo_heads": 8,
        "num_kv_heads": 2,
        "head_dim": 64,
        "page_size": 4,
        "dtype": torch.float32,
    } | other
    foreign = PrefixAttention(**args)
    table = TABLE if foreign.page_size == 4 else np.array([[0, 1, 2, 3, 4], [0, 1, 5, 6, 7]])
    plan = foreign.plan(table, LENS)
    with pytest.raises(ValueError, match=f"another geometry than this object: {message}"):
        _pa().run(*_inputs(num_pages=8), plan=plan)


@pytest.mark.parametrize(
    ("scale", "error", "message"),
    [
        (float("nan"), ValueError, "scale must be finite, got nan"),
        (float("inf"), ValueError, "scale must be finite"),
        ("0.5", TypeError, "scale must be a real number, got str"),
        (torch.tensor([1.0, 2.0]), TypeError, "scale must be a real number, got Tensor"),
        (True, TypeError, "scale must be a real number, got bool"),
    ],
)
def test_run_rejects_bad_scale(scale, error, message) -> None:
    pa = _pa()
    pa.plan(TABLE, LENS)
    with pytest.raises(error, match=message):
        pa.run(*_inputs(), scale=scale)


def test_run_rejects_bad_out_and_plan_objects() -> None:
    pa = _pa()
    pa.plan(TABLE, LENS)
    q, k, v = _inputs()
    with pytest.raises(TypeError, match=r"out must be a torch\.Tensor, got list"):
        pa.run(q, k, v, out=[[0]])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="plan must be a LaunchPlan, got dict"):
        pa.run(q, k, v, plan={})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="out has overlapping elements"):
        pa.run(q, k, v, out=torch.empty(1, 8, 64).expand(2, 8, 64))
    with pytest.raises(ValueError, match="out requires grad"):
        pa.run(q, k, v, out=torch.empty(2, 8, 64, requires_grad=True))
    # numpy and int scales are fine (np.float32 is no float subclass: outside the annotation).
    pa.run(q, k, v, scale=np.float32(0.125))  # type: ignore[arg-type]
    pa.run(q, k, v, scale=1)
