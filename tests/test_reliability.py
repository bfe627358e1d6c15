"""Bad or extreme input gets a clear error (never a crash, a hang, memory exhaustion or a
silently wrong output): tile tables, huge split targets, huge lengths, threads, ambiguous
cache layouts, the raw native planner's own checks, and the plan memory guard."""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest
import torch
from conftest import NATIVE_OR_PYTHON

from prefixattn import PlanOptions, PrefixAttention
from prefixattn.plan.native import build_plan_native
from prefixattn.plan.packing import BatchShape, page_runs
from prefixattn.plan.planner import estimate_plan
from prefixattn.plan.tiles import TileTable, tile_table
from prefixattn.runtime.reference import attention_reference

HOST_FIELDS = (
    "kv_page_offset", "kv_pages", "kv_start", "kv_len", "q_indptr", "q_tokens", "q_limit",
    "q_out", "tile_id", "tile_indptr", "merge_tokens", "merge_indptr", "merge_partials",
)  # fmt: skip


def _pa(native: bool, **kw) -> PrefixAttention:
    kw.setdefault("dtype", torch.float32)
    pa = PrefixAttention(8, 2, 64, kw.pop("page_size", 4), **kw)
    pa.native_plan = native
    return pa


def _same_plan(a, b) -> None:
    for name in HOST_FIELDS:
        np.testing.assert_array_equal(getattr(a.host, name), getattr(b.host, name), name)
    assert a.tiles == b.tiles and a.tile_indptr == b.tile_indptr
    assert torch.equal(a.counts, b.counts)


def _cache(num_pages: int, page_size: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(num_pages, page_size, 2, 64, generator=g)
    v = torch.randn(num_pages, page_size, 2, 64, generator=g)
    return k, v


# ---------------------------------------------------------------- 1. tile tables
@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"m_sizes": (0,)}, "m_sizes"),  # largest height 0: a division by zero in planners
        ({"m_sizes": (16, 0)}, "m_sizes"),
        ({"m_sizes": (-16, 16)}, "m_sizes"),
        ({"m_sizes": (32, 16)}, "m_sizes"),  # not ascending
        ({"m_sizes": (16, 16)}, "m_sizes"),
        ({"m_sizes": ()}, "m_sizes"),
        ({"n_by_kv_len": ()}, "n_by_kv_len"),
        ({"n_by_kv_len": ((128, 0),)}, "n_by_kv_len"),  # KV tile out of range
        ({"n_by_kv_len": ((128, 65536),)}, "n_by_kv_len"),
        ({"n_by_kv_len": ((256, 64), (128, 128))}, "n_by_kv_len"),  # bounds not ascending
        ({"narrow_m_sizes": (0, 16)}, "narrow_m_sizes"),
        ({"wide_rows": -1}, "wide_rows"),
        ({"wide_kv_len": -5}, "wide_kv_len"),
        ({"narrow_traffic": float("nan")}, "narrow_traffic"),
    ],
)
def test_invalid_tile_table_is_rejected_when_made(change: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"TileTable\.{field}"):
        dataclasses.replace(tile_table(128), **change)
    with pytest.raises(ValueError, match=rf"TileTable\.{field}"):
        TileTable(**{"m_sizes": (16,), "n_by_kv_len": ((1 << 30, 64),), **change})


@pytest.mark.parametrize("native", NATIVE_OR_PYTHON)
def test_planners_never_see_an_invalid_tile_table(native: bool) -> None:
    pa = _pa(native)
    table = np.array([[0, 1], [0, 2]], dtype=np.int32)
    lens = np.array([7, 8])
    with pytest.raises(ValueError, match=r"TileTable\.m_sizes\[0\] = 0"):
        pa.tiles = TileTable(m_sizes=(0,), n_by_kv_len=((1 << 30, 64),))
    with pytest.raises(TypeError, match="tiles must be a TileTable"):
        pa.tiles = ((0,), ((1 << 30, 64),))  # type: ignore[assignment]
    # The object's table is unchanged, and a valid custom table plans.
    assert pa.tiles == tile_table(64)
    pa.tiles = TileTable(m_sizes=(16,), n_by_kv_len=((1 << 30, 64),))
    plan = pa.plan(table, lens)
    assert plan.tiles == ((16, 64),)


@pytest.mark.native
def test_raw_native_op_rejects_a_zero_height() -> None:
    # The table checks of the compiled planner itself (no SIGFPE).
    with pytest.raises(ValueError, match="m sizes must be positive and ascending"):
        torch.ops.prefixattn.build_plan(
            torch.zeros(1, 2, dtype=torch.int32), torch.tensor([5]), torch.tensor([0, 1]),
            4, 8, 2, 64, 2, [0], [1 << 30], [64], "memory", True, 132, True, 0, 0, False, 0,
        )  # fmt: skip


# ----------------------------------------------------------- 2. huge split targets
def _split_batch():
    """Long decode requests at page size 4 whose items the split rule cuts."""
    lens = np.array([4000, 3100, 2600, 700, 33])
    table = np.arange(len(lens) * 1000, dtype=np.int32).reshape(len(lens), 1000)
    table[1, :300] = table[0, :300]  # some sharing
    return table, lens


@pytest.mark.parametrize("native", NATIVE_OR_PYTHON)
@pytest.mark.parametrize("target", [10**13, 2**62, 2**63 - 1])
def test_huge_split_target_plans_like_a_large_safe_one(native: bool, target: int) -> None:
    table, lens = _split_batch()
    safe = _pa(native)
    safe.split_target = 2**31 - 1  # already beyond every chunk's balance: cut to the floor
    expected = safe.plan(table, lens)
    assert expected.num_work_items > np.count_nonzero(lens)  # the batch is split
    pa = _pa(native)
    pa.split_target = target
    plan = pa.plan(table, lens)
    _same_plan(plan, expected)
    # And it runs: every token of the output is written and right.
    k, v = _cache(int(table.max()) + 1, 4)
    q = torch.randn(len(lens), 8, 64)
    out = torch.full_like(q, float("nan"))
    pa.run(q, k, v, out=out)
    ref = attention_reference(q, k, v, torch.from_numpy(table), torch.from_numpy(lens))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("target", [2**63, 2**64, -1])
def test_split_target_beyond_int64_is_rejected_when_set(target: int) -> None:
    with pytest.raises(ValueError, match=r"PlanOptions\.split_target must be in \[0, "):
        PlanOptions(split_target=target)
    pa = _pa(False)
    with pytest.raises(ValueError, match=r"PlanOptions\.split_target"):
        pa.split_target = target
    assert pa.split_target is None


# ------------------------------------------------------------ 3. lengths >= 2**31
@pytest.mark.parametrize("native", NATIVE_OR_PYTHON)
@pytest.mark.parametrize("length", [2**31, 2**31 + 5, 2**40])
def test_seq_len_beyond_int32_is_rejected_before_planning(native: bool, length: int) -> None:
    pa = _pa(native, page_size=128)
    lens = np.array([9, length], dtype=np.int64)
    message = rf"seq_lens\[1\] = {length} is beyond int32 range: request 1"
    table = np.zeros((2, 4), dtype=np.int32)
    with pytest.raises(ValueError, match=message):
        pa.plan(table, lens)
    device_table = torch.zeros((2, 4), dtype=torch.int32)
    with pytest.raises(ValueError, match=message):
        pa.plan_unshared(device_table, lens)
    with pytest.raises(ValueError, match=message):
        pa.plan_hinted(device_table, table, lens)


@pytest.mark.parametrize("native", NATIVE_OR_PYTHON)
def test_seq_len_beyond_int32_with_a_table_wide_enough(native: bool) -> None:
    # The table holds every page of a 2**31-token request (page size 128): the old planners
    # accepted it and wrapped the causal bound to a negative one.
    pa = _pa(native, page_size=128)
    table = np.zeros((1, 2**24), dtype=np.int32)
    with pytest.raises(ValueError, match=r"seq_lens\[0\] = 2147483648 is beyond int32"):
        pa.plan(table, np.array([2**31]))


def test_total_query_tokens_beyond_int32_are_rejected() -> None:
    pa = _pa(False)
    lens = np.array([2**31 - 1, 2**31 - 1])
    indptr = np.array([0, 2**31 - 1, 2**32 - 2])
    with pytest.raises(ValueError, match=r"qo_indptr holds 4294967294 query tokens, more than"):
        pa.plan(np.zeros((2, 1), dtype=np.int32), lens, indptr)


# ------------------------------------------------------------------- 4. threads
def _thread_batch(seed: int):
    rng = np.random.default_rng(seed)
    b = 6
    lens = rng.integers(20, 60, size=b)
    table = rng.permutation(b * 16).astype(np.int32).reshape(b, 16)
    table[1:, :2] = table[0, :2]  # a shared prefix
    qo = rng.integers(1, 4, size=b)
    qo[-1] += 18 - qo.sum()  # the same 18 tokens in every batch
    indptr = np.concatenate(([0], np.cumsum(qo)))
    return table, lens, indptr


@pytest.mark.parametrize("native", NATIVE_OR_PYTHON)
def test_two_threads_planning_and_running_one_object(native: bool) -> None:
    """Each thread plans, then both run with the default plan: each gets its own."""
    pa = _pa(native)
    k, v = _cache(96, 4)
    rounds = 12
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []
    wrong: list[str] = []

    def work(tid: int) -> None:
        try:
            for r in range(rounds):
                table, lens, indptr = _thread_batch(100 * tid + r)
                q = torch.randn(int(indptr[-1]), 8, 64)
                # Thread 0 plans first, then thread 1, then both run their default plan.
                for turn in range(2):
                    if turn == tid:
                        pa.plan(table, lens, indptr)
                    barrier.wait()
                out = pa.run(q, k, v)
                ref = attention_reference(
                    q, k, v, torch.from_numpy(table), torch.from_numpy(lens),
                    torch.from_numpy(indptr),
                )  # fmt: skip
                if not torch.allclose(out, ref, rtol=1e-4, atol=1e-4):
                    wrong.append(f"thread {tid} round {r}")
                barrier.wait()
        except BaseException as e:
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=work, args=(t,)) for t in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert not wrong, wrong


def test_run_in_a_thread_that_never_planned() -> None:
    pa = _pa(False)
    pa.plan(np.array([[0, 1]], dtype=np.int32), np.array([5]))
    k, v = _cache(2, 4)
    raised: list[BaseException] = []
    t = threading.Thread(target=lambda: _catch(raised, lambda: pa.run(torch.randn(1, 8, 64), k, v)))
    t.start()
    t.join()
    assert len(raised) == 1 and isinstance(raised[0], RuntimeError)
    assert "before plan() in this thread" in str(raised[0])
    assert pa.last_plan is not None  # this thread's plan


def _catch(into: list[BaseException], fn) -> None:
    try:
        fn()
    except BaseException as e:
        into.append(e)


@pytest.fixture
def shared_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU objects behave as CUDA ones do: plans share the object's buffers."""
    monkeypatch.setattr(PrefixAttention, "_plans_share_buffers", property(lambda self: True))


@pytest.mark.usefixtures("shared_buffers")
def test_shared_buffers_make_older_plans_stale() -> None:
    pa = _pa(False)
    k, v = _cache(96, 4)
    t1, l1, i1 = _thread_batch(1)
    t2, l2, i2 = _thread_batch(2)
    first = pa.plan(t1, l1, i1)
    second = pa.plan(t2, l2, i2)
    q = torch.randn(18, 8, 64)
    with pytest.raises(
        RuntimeError, match=r"stale plan: the device arrays of plan #1 .* later plan \(#2"
    ):
        pa.run(q, k, v, plan=first)
    pa.run(q, k, v, plan=second)
    pa.run(q, k, v)  # the latest plan is the default
    # Another object's plans are not this object's to judge.
    other = _pa(False)
    other.plan(t1, l1, i1)
    other.run(q, k, v, plan=second)


@pytest.mark.usefixtures("shared_buffers")
def test_threads_with_shared_buffers_get_the_clear_error_or_the_right_output() -> None:
    pa = _pa(False)
    k, v = _cache(96, 4)
    barrier = threading.Barrier(2)
    outcomes: list[str] = []
    lock = threading.Lock()

    def work(tid: int) -> None:
        for r in range(10):
            table, lens, indptr = _thread_batch(100 * tid + r)
            q = torch.randn(int(indptr[-1]), 8, 64)
            for turn in range(2):
                if turn == tid:
                    pa.plan(table, lens, indptr)
                barrier.wait()
            try:
                out = pa.run(q, k, v)
            except RuntimeError as e:
                result = "stale" if "stale plan" in str(e) else f"error {e}"
            else:
                ref = attention_reference(
                    q, k, v, torch.from_numpy(table), torch.from_numpy(lens),
                    torch.from_numpy(indptr),
                )  # fmt: skip
                result = "ok" if torch.allclose(out, ref, rtol=1e-4, atol=1e-4) else "wrong"
            with lock:
                outcomes.append(f"{tid}:{result}")
            barrier.wait()

    threads = [threading.Thread(target=work, args=(t,)) for t in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    # Thread 0's plan was overwritten by thread 1's every round; thread 1's is the latest.
    assert sorted(outcomes) == sorted(["0:stale"] * 10 + ["1:ok"] * 10), outcomes


# ------------------------------------------------- 5. NHD and HND when page_size == heads
def _square(kv_layout: str) -> PrefixAttention:
    pa = PrefixAttention(4, 2, 64, 2, kv_layout=kv_layout, dtype=torch.float32)
    pa.plan(np.array([[0, 1], [0, 2]], dtype=np.int32), np.array([4, 3]))
    return pa


@pytest.mark.parametrize(("declared", "other"), [("NHD", "HND"), ("HND", "NHD")])
def test_cache_in_the_other_layout_order_is_rejected(declared: str, other: str) -> None:
    pa = _square(declared)
    q = torch.randn(2, 4, 64)
    # A cache in `other` memory order viewed with the declared shape (dims 1, 2 swapped).
    k = torch.randn(3, 2, 2, 64).transpose(1, 2)
    v = torch.randn(3, 2, 2, 64).transpose(1, 2)
    with pytest.raises(ValueError, match=rf"order of a {other} cache.*kv_layout '{declared}'"):
        pa.run(q, k, v)
    with pytest.raises(ValueError, match=r"v_cache .*order of a"):
        pa.run(q, k.contiguous(), v)


@pytest.mark.parametrize("declared", ["NHD", "HND"])
def test_contiguous_and_packed_caches_are_read_in_the_declared_layout(declared: str) -> None:
    pa = _square(declared)
    q = torch.randn(2, 4, 64)
    lens, table = torch.tensor([4, 3]), torch.tensor([[0, 1], [0, 2]])
    # vLLM's packed K/V: memory [pages, 2 (dim 1), 2 (dim 2), 2 * D], K and V halves.
    kv = torch.randn(3, 2, 2, 128)
    k, v = kv.split(64, dim=-1)
    assert k.stride() == (512, 256, 128, 1)
    for kc, vc in ((k, v), (k.contiguous(), v.contiguous())):
        out = pa.run(q, kc, vc)
        ref = attention_reference(q, kc, vc, table, lens, kv_layout=declared)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_other_shapes_accept_any_strides() -> None:
    # page_size != num_kv_heads: the shape tells the layout, and a transposed view is fine.
    pa = PrefixAttention(4, 2, 64, 4, dtype=torch.float32)
    pa.plan(np.array([[0, 1]], dtype=np.int32), np.array([7]))
    k = torch.randn(2, 2, 4, 64).transpose(1, 2)  # NHD view of HND memory
    v = torch.randn(2, 2, 4, 64).transpose(1, 2)
    q = torch.randn(1, 4, 64)
    ref = attention_reference(q, k, v, torch.tensor([[0, 1]]), torch.tensor([7]))
    torch.testing.assert_close(pa.run(q, k, v), ref, rtol=1e-4, atol=1e-4)


# ------------------------------------------- 6. the raw native planner's own checks
def _raw(table, lens, indptr, *, reuse: bool = False, split_target: int = 132, ps: int = 2):
    return torch.ops.prefixattn.build_plan(
        table, lens, indptr, ps, 8, 2, 64, 2, [16, 32, 64, 128], [128, 1 << 30], [64, 128],
        "memory", True, split_target, True, 0, 0, reuse, 0,
    )  # fmt: skip


NATIVE_BAD_INPUTS = [
    pytest.param(
        [[3, -1, 4], [3, -1, 2]], [5, 6], [0, 1, 2], IndexError,
        r"block_table\[\d, 1\] = -1 is a negative page id", id="negative-id",
    ),
    pytest.param(
        [[3, 1, 4], [3, 1, 2]], [5, 2], [0, 1, 4], ValueError,
        r"qo_indptr gives request 1 3 new tokens but seq_lens\[1\] is 2", id="queries>len",
    ),
    pytest.param(
        [[3, 1, 4], [3, 1, 2]], [5, 2**31], [0, 1, 2], ValueError,
        r"seq_lens\[1\] = 2147483648 is beyond int32 range", id="len>=2**31",
    ),
    pytest.param(
        [[3, 1, 4], [3, 1, 2]], [5, -3], [0, 1, 1], ValueError,
        r"seq_lens\[1\] = -3 is negative", id="negative-len",
    ),
]  # fmt: skip


@pytest.mark.native
@pytest.mark.parametrize(("rows", "lens", "indptr", "error", "message"), NATIVE_BAD_INPUTS)
def test_raw_native_op_rejects(rows, lens, indptr, error, message) -> None:
    args = (np.array(rows, dtype=np.int32), np.array(lens), np.array(indptr))
    with pytest.raises(error, match=message):
        _raw(*(torch.from_numpy(a) for a in args))
    with pytest.raises(error, match=message):
        build_plan_native(*args, 2, BatchShape(8, 2, 64, 2), tile_table(64), "memory", True)


@pytest.mark.native
def test_raw_native_op_rejects_a_stale_forest() -> None:
    table = torch.tensor([[3, 1, 4], [3, 1, 2]], dtype=torch.int32)
    lens, indptr = torch.tensor([5, 6]), torch.tensor([0, 1, 2])
    _raw(table, lens, indptr)
    _raw(table, lens, indptr, reuse=True)  # the same inputs: fine
    lens[1] = 3  # the same buffers, changed in place: the kept forest is stale
    with pytest.raises(ValueError, match="reuse_forest: the kept forest was built from another"):
        _raw(table, lens, indptr, reuse=True)
    _raw(table, lens, indptr)  # without reuse_forest it builds anew
    table[1, 0] = 9  # another first page
    with pytest.raises(ValueError, match="reuse_forest"):
        _raw(table, lens, indptr, reuse=True)


@pytest.mark.native
def test_raw_native_op_takes_any_int64_split_target() -> None:
    table, lens = (torch.from_numpy(a) for a in _split_batch())
    indptr = torch.arange(len(lens) + 1)
    safe = _raw(table, lens, indptr, split_target=2**31 - 1, ps=4)
    assert len(safe[2]) > 0
    for target in (10**13, 2**62, 2**63 - 1):
        got = _raw(table, lens, indptr, split_target=target, ps=4)
        for a, b in zip(got, safe, strict=True):
            assert torch.equal(a, b)
    with pytest.raises(ValueError, match="split_target must be >= 0"):
        _raw(table, lens, indptr, split_target=-1, ps=4)


@pytest.mark.parametrize("native", NATIVE_OR_PYTHON)
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_both_planners_report_the_same_negative_page_id(native: bool, dtype) -> None:
    # Rows 0, 2 and 3 read the -1 (the compiled planner alone meets it first in row 3's item);
    # row 1's -1 is past its pages (never read).
    table = np.array([[3, -1, 4], [3, -1, 5], [3, -1, 5], [3, -1, 2]], dtype=dtype)
    lens = np.array([3, 1, 2, 3])
    pa = _pa(native, page_size=1)
    with pytest.raises(IndexError, match=r"^block_table\[0, 1\] = -1 is a negative page id$"):
        pa.plan(table, lens)
    table[[0, 2, 3], 1] = 6
    pa.plan(table, lens)  # the -1 left is never read


# ---------------------------------------------------------- 7. plan memory guard
def test_plan_estimate_is_linear_in_context_and_chunk() -> None:
    tiles = tile_table(128)
    big = estimate_plan(np.array([2**20]), np.array([0, 2**16]), 1, 4, tiles)
    # A 64K-token chunk into a 1M-token context at page size 1: the context's page ids once
    # per plan built (the narrow table's plan beside the first), not once per row chunk.
    assert big.pages == 2 * 2**20 and big.nbytes < 200 * 2**20
    small = estimate_plan(np.full(64, 4096), np.arange(65), 16, 4, tiles)
    assert small.nbytes < 2**24


@pytest.mark.parametrize("native", NATIVE_OR_PYTHON)
def test_chunked_prefill_stores_the_context_once(native: bool) -> None:
    # A 4096-token chunk into a 64K-token context at page size 1: 128 row chunks that all
    # read the same row; the plan stores its 64K page ids once and every chunk points at them.
    ctx, chunk = 2**16, 4096
    pa = PrefixAttention(32, 8, 128, 1, dtype=torch.float32)
    pa.native_plan = native
    table = np.random.default_rng(0).permutation(ctx).astype(np.int32)[None, :]
    plan = pa.plan(table, np.array([ctx]), np.array([0, chunk]))
    h = plan.host
    assert plan.num_work_items == chunk * 4 // 128
    assert np.array_equal(h.kv_pages, table[0])
    assert np.array_equal(h.kv_page_offset, h.kv_start)  # item w reads from its start column
    assert np.array_equal(np.sort(h.kv_len), ctx - chunk + 32 * np.arange(1, 129))


def testpage_runs_worked_example() -> None:
    table = np.arange(20, dtype=np.int32).reshape(2, 10)
    offset, pages = page_runs(
        table, np.array([0, 1, 0, 1]), np.array([0, 2, 2, 7]), np.array([4, 2, 4, 0])
    )
    assert offset.tolist() == [0, 6, 2, 0]
    assert pages.tolist() == [0, 1, 2, 3, 4, 5, 12, 13]


@pytest.mark.parametrize("native", NATIVE_OR_PYTHON)
def test_plan_over_the_memory_limit_is_refused(native: bool) -> None:
    # A 1024-token prefill chunk into a 16K-token context at page size 1, over a 256 KiB limit.
    pa = PrefixAttention(32, 8, 128, 1, dtype=torch.float32)
    pa.native_plan = native
    pa.max_plan_bytes = 2**18
    lens, indptr = np.array([2**14]), np.array([0, 1024])
    table = np.arange(2**14, dtype=np.int32)[None, :]
    device_table = torch.zeros((1, 2**14), dtype=torch.int32)
    message = r"about .* GiB \(\d+ work items, 2048 query slots, \d+ page ids\).*max_plan_bytes"
    with pytest.raises(MemoryError, match=message):
        pa.plan(table, lens, indptr)
    with pytest.raises(MemoryError, match=message):
        pa.plan_unshared(device_table, lens, indptr)
    assert pa.last_plan is None
    # Within the default limit it plans.
    pa.max_plan_bytes = PlanOptions().max_plan_bytes
    assert pa.plan(table, lens, indptr).num_tokens == 1024
    pa.max_plan_bytes = None  # no limit
    pa.plan(table, lens, indptr)


@pytest.mark.parametrize(
    ("value", "error"), [(-1, ValueError), (2**63, ValueError), (1.5, TypeError)]
)
def test_bad_max_plan_bytes_is_rejected(value, error) -> None:
    with pytest.raises(error, match=r"PlanOptions\.max_plan_bytes"):
        PlanOptions(max_plan_bytes=value)
