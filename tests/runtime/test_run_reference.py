"""``PrefixAttention.run`` on CPU tensors (the plan executed by the PyTorch reference) equals
plain gathered attention."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import Batch, batches, random_cache
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixattn import PrefixAttention, attention_reference, tree_batch

PACKINGS = ("memory", "naive", "per_query")


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    scale = ref.abs().max().item()
    return (out.double() - ref.double()).abs().max().item() / max(scale, 1e-30)


def _run(
    batch: Batch,
    hq: int,
    hkv: int,
    d: int,
    dtype: torch.dtype,
    packing: str,
    split_kv: bool,
    layout: str = "NHD",
    interleaved: bool = False,
    seed: int = 0,
):
    k, v = random_cache(batch.num_pages, batch.page_size, hkv, d, dtype, layout, interleaved, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(int(batch.qo_indptr[-1]), hq, d, generator=gen).to(dtype)
    pa = PrefixAttention(hq, hkv, d, batch.page_size, kv_layout=layout, dtype=dtype)
    pa.plan(batch.block_table, batch.seq_lens, batch.qo_indptr, packing=packing, split_kv=split_kv)
    out = pa.run(q, k, v)
    ref = attention_reference(
        q.double(),
        k.double(),
        v.double(),
        torch.from_numpy(batch.block_table),
        torch.from_numpy(batch.seq_lens),
        torch.from_numpy(batch.qo_indptr),
        kv_layout=layout,
    )
    return out, ref


@settings(max_examples=120, deadline=None)
@given(
    batches(),
    st.sampled_from([(1, 1), (4, 4), (8, 2), (7, 1), (10, 2), (16, 1), (32, 2)]),
    st.sampled_from(PACKINGS),
    st.booleans(),
    st.sampled_from(["NHD", "HND"]),
    st.booleans(),
)
def test_float32_matches_float64_attention(
    batch: Batch,
    heads: tuple[int, int],
    packing: str,
    split_kv: bool,
    layout: str,
    interleaved: bool,
) -> None:
    out, ref = _run(batch, *heads, 64, torch.float32, packing, split_kv, layout, interleaved)
    assert out.dtype == torch.float32
    if out.numel():
        assert _relative_error(out, ref) < 1e-5


@settings(max_examples=30, deadline=None)
@given(batches(max_requests=6, max_pages=6), st.sampled_from([64, 128, 256]))
def test_float64_is_exact_to_rounding(batch: Batch, d: int) -> None:
    out, ref = _run(batch, 8, 2, d, torch.float64, "memory", True)
    if out.numel():
        assert _relative_error(out, ref) < 1e-12


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs(dtype: torch.dtype) -> None:
    # Error bound: the output is rounded once to the input dtype (a few ulps of values ~1).
    table, lens = tree_batch("1,3,9_48,16,5", page_size=16)
    batch = Batch(table, lens, np.arange(10, dtype=np.int32), 16, int(table.max()) + 1)
    out, ref = _run(batch, 8, 2, 64, dtype, "memory", True)
    assert out.dtype == dtype
    eps = torch.finfo(dtype).eps
    assert (out.double() - ref).abs().max().item() <= 4 * eps * ref.abs().max().item()


def test_pat_tree_with_prefill_and_speculative_queries() -> None:
    # Requests of 1, 3 and 17 new tokens (decode, speculative verification, chunked prefill).
    table, lens = tree_batch("1,2,6_64,32,21", page_size=16)
    qo = np.array([1, 3, 17, 1, 2, 1])
    batch = Batch(
        table, lens, np.concatenate(([0], np.cumsum(qo))).astype(np.int32), 16, int(table.max()) + 1
    )
    for packing in PACKINGS:
        out, ref = _run(batch, 12, 4, 128, torch.float32, packing, True)
        assert _relative_error(out, ref) < 1e-5


def test_out_is_written_in_place_and_scale_is_used() -> None:
    table, lens = tree_batch("1,4_32,3", page_size=2)
    k, v = random_cache(int(table.max()) + 1, 2, 2, 64, torch.float32)
    q = torch.randn(4, 4, 64, generator=torch.Generator().manual_seed(7))
    pa = PrefixAttention(4, 2, 64, 2, dtype=torch.float32)
    pa.plan(table, lens)
    out = torch.full_like(q, math.nan)
    assert pa.run(q, k, v, out=out, scale=0.3) is out
    # fp32 against an fp64 reference: partials merged in another order than plain attention
    # sums differ by a few fp32 ulps; a wrong scale differs by orders of magnitude more.
    ref = attention_reference(
        q.double(),
        k.double(),
        v.double(),
        torch.from_numpy(table),
        torch.from_numpy(lens),
        scale=0.3,
    ).float()
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    default = pa.run(q, k, v)
    assert not torch.allclose(default, out)


def test_requests_without_new_tokens_are_skipped() -> None:
    table, lens = tree_batch("1,4_32,8", page_size=4)
    qo_indptr = np.array([0, 1, 1, 3, 3], dtype=np.int32)  # requests 1 and 3: no new tokens
    batch = Batch(table, lens, qo_indptr, 4, int(table.max()) + 1)
    out, ref = _run(batch, 4, 4, 64, torch.float32, "memory", True)
    assert out.shape[0] == 3
    assert _relative_error(out, ref) < 1e-5


def _decode_inputs(table: np.ndarray, lens: np.ndarray, hq: int, hkv: int, d: int):
    """float64 K and V caches (page size 16) for ``table`` and one decode query per request."""
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(int(table.max()) + 1, 16, hkv, d, generator=gen, dtype=torch.float64)
    v = torch.randn(int(table.max()) + 1, 16, hkv, d, generator=gen, dtype=torch.float64)
    q = torch.randn(len(lens), hq, d, generator=gen, dtype=torch.float64)
    return q, k, v


@pytest.mark.parametrize("spec", ["1,256_256,32", "1,4,256_32,256,32"])
def test_finished_tokens_give_the_same_output(spec: str) -> None:
    # Plans whose leaf items finish merged tokens (q_out = -2 - i) and plans that merge every
    # token run the same attention.
    table, lens = tree_batch(spec, page_size=16)
    hq, hkv, d = 32, 8, 128
    q, k, v = _decode_inputs(table, lens, hq, hkv, d)
    pa = PrefixAttention(hq, hkv, d, 16, dtype=torch.float64)
    pa.split_target = 132
    pa.plan(table, lens)
    assert pa.last_plan is not None and pa.last_plan.num_finished > 0
    out = pa.run(q, k, v)
    pa.finish_in_leaf = False
    pa.plan(table, lens)
    plain = pa.run(q, k, v)
    ref = attention_reference(q, k, v, torch.as_tensor(table), torch.as_tensor(lens))
    assert _relative_error(out, ref) < 1e-12 and _relative_error(plain, ref) < 1e-12


@settings(max_examples=60, deadline=None)
@given(
    batches(),
    st.sampled_from([(4, 4), (8, 2), (32, 2)]),
    st.sampled_from([1, 4, 16, 132]),
)
def test_split_waves_plans_equal_attention(
    batch: Batch, heads: tuple[int, int], target: int
) -> None:
    hq, hkv = heads
    k, v = random_cache(batch.num_pages, batch.page_size, hkv, 64, torch.float64, "NHD", False, 0)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(int(batch.qo_indptr[-1]), hq, 64, generator=gen, dtype=torch.float64)
    pa = PrefixAttention(hq, hkv, 64, batch.page_size, dtype=torch.float64)
    pa.split_target = target
    pa.split_waves = True
    pa.plan(batch.block_table, batch.seq_lens, batch.qo_indptr)
    out = pa.run(q, k, v)
    ref = attention_reference(
        q, k, v, torch.from_numpy(batch.block_table), torch.from_numpy(batch.seq_lens),
        torch.from_numpy(batch.qo_indptr),
    )  # fmt: skip
    if out.numel():
        assert _relative_error(out, ref) < 1e-12


def test_split_waves_changes_the_plan_not_the_output() -> None:
    # 128 requests x group 4 under a 1024-token root at a target of 66 SMs: the rule cuts
    # the root's 4 row chunks into 4 parts (128 pairs, 2 rounds); split_waves into 2 (64
    # pairs, one round).
    table, lens = tree_batch("1,128_1024,8", page_size=16)
    hq, hkv, d = 32, 8, 64
    q, k, v = _decode_inputs(table, lens, hq, hkv, d)
    pa = PrefixAttention(hq, hkv, d, 16, dtype=torch.float64)
    pa.split_target = 66
    pa.split_waves = False
    rule = pa.plan(table, lens)
    pa.split_waves = True
    waves = pa.plan(table, lens)
    assert (rule.num_work_items, waves.num_work_items) == (144, 136)
    out = pa.run(q, k, v)
    ref = attention_reference(q, k, v, torch.as_tensor(table), torch.as_tensor(lens))
    assert _relative_error(out, ref) < 1e-12


@pytest.mark.parametrize("floor", [64, 16])
@pytest.mark.parametrize("spec", ["1_1408", "4_1408", "1,4_1024,384"])
def test_split_floor_changes_the_plan_not_the_output(spec: str, floor: int) -> None:
    # The leaf floor cuts small decode batches into more, shorter parts (one request of 1408
    # tokens: 5 parts at 256, 22 at 64); the output stays exact.
    table, lens = tree_batch(spec, page_size=16)
    hq, hkv, d = 32, 8, 64
    q, k, v = _decode_inputs(table, lens, hq, hkv, d)
    pa = PrefixAttention(hq, hkv, d, 16, dtype=torch.float64)
    pa.leaf_split_tokens = 256
    coarse = pa.plan(table, lens)
    pa.leaf_split_tokens = floor
    fine = pa.plan(table, lens)
    assert fine.num_work_items > coarse.num_work_items
    assert int(fine.host.kv_len.min()) >= floor
    out = pa.run(q, k, v)
    ref = attention_reference(q, k, v, torch.as_tensor(table), torch.as_tensor(lens))
    assert _relative_error(out, ref) < 1e-12
