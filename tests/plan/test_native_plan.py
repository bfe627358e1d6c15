"""The native plan builder produces exactly the Python forest and plan."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import Batch, batches
from hypothesis import given, settings
from hypothesis import strategies as st

import prefixattn
from prefixattn import PAT_TREES, build_forest, tree_batch
from prefixattn.plan.native import build_plan_native
from prefixattn.plan.packing import PACKINGS, BatchShape, finish_in_leaf, pack
from prefixattn.plan.planner import DEVICE_ARRAYS
from prefixattn.plan.tiles import tile_table

pytestmark = pytest.mark.native

FOREST_ARRAYS = (
    "parent",
    "page_begin",
    "page_end",
    "token_end",
    "req_begin",
    "req_end",
    "order",
    "ending_indptr",
    "ending_reqs",
)
HEADS = [(4, 4), (8, 2), (14, 2), (16, 1), (12, 4), (32, 8), (64, 8), (128, 8)]


def _python(
    block_table,
    seq_lens,
    qo_indptr,
    page_size,
    shape,
    table,
    packing,
    split_kv,
    split_target=0,
    skip_idle=True,
    split_waves=False,
    min_split_tokens=256,
    leaf_split_tokens=64,
):
    lens = np.asarray(seq_lens).astype(np.int64)
    indptr = np.asarray(qo_indptr).astype(np.int64)
    forest_lens = np.where(np.diff(indptr) > 0, lens, 0) if skip_idle else lens
    forest = build_forest(block_table, forest_lens, page_size)
    return (
        forest,
        *pack(
            forest, block_table, lens, indptr, shape, table, packing, split_kv, split_target,
            split_waves=split_waves, min_split_tokens=min_split_tokens,
            leaf_split_tokens=leaf_split_tokens,
        ),
    )  # fmt: skip


def _assert_same(expected, actual) -> None:
    f_py, host_py, tiles_py, indptr_py, acc_py = expected
    f_nat, host_nat, tiles_nat, indptr_nat, acc_nat = actual
    assert f_nat.page_size == f_py.page_size
    for name in FOREST_ARRAYS:
        a, b = getattr(f_py, name), getattr(f_nat, name)
        assert a.dtype == b.dtype, name
        np.testing.assert_array_equal(b, a, err_msg=f"forest.{name}")
    assert f_nat.children == f_py.children
    for name in host_py.__dataclass_fields__:
        a, b = getattr(host_py, name), getattr(host_nat, name)
        assert a.dtype == b.dtype, name
        np.testing.assert_array_equal(b, a, err_msg=f"plan.{name}")
    assert tiles_nat == tiles_py
    assert indptr_nat == indptr_py
    assert acc_nat == acc_py


def _compare(
    batch: Batch,
    heads: tuple[int, int],
    head_dim: int,
    elem_bytes: int,
    packing: str,
    split_kv: bool,
    skip_idle: bool = True,
    split_target: int = 132,
    split_waves: bool = False,
    min_split_tokens: int = 256,
    leaf_split_tokens: int = 64,
) -> None:
    shape = BatchShape(heads[0], heads[1], head_dim, elem_bytes)
    table = tile_table(head_dim)
    args = (
        batch.block_table,
        batch.seq_lens,
        batch.qo_indptr,
        batch.page_size,
        shape,
        table,
        packing,
        split_kv,
        split_target,
    )
    floors = (min_split_tokens, leaf_split_tokens)
    expected = _python(
        *args, skip_idle=skip_idle, split_waves=split_waves, min_split_tokens=floors[0],
        leaf_split_tokens=floors[1],
    )  # fmt: skip
    actual = build_plan_native(
        *args, forest_skips_idle=skip_idle, split_waves=split_waves, min_split_tokens=floors[0],
        leaf_split_tokens=floors[1],
    )  # fmt: skip
    _assert_same(expected, actual)


@settings(max_examples=300, deadline=None)
@given(
    batches(page_sizes=tuple(range(1, 17))),
    st.sampled_from(HEADS),
    st.sampled_from([64, 128, 256]),
    st.sampled_from([2, 4]),
    st.sampled_from(PACKINGS),
    st.booleans(),
    st.sampled_from([0, 1, 4, 9, 16, 132]),
    st.booleans(),
    st.sampled_from([256, 64, 16, 3, 1]),
    st.sampled_from([64, 256, 16, 1]),
)
def test_random_batches(
    batch: Batch,
    heads: tuple[int, int],
    head_dim: int,
    elem_bytes: int,
    packing: str,
    split_kv: bool,
    split_target: int,
    split_waves: bool,
    min_split_tokens: int,
    leaf_split_tokens: int,
) -> None:
    _compare(
        batch, heads, head_dim, elem_bytes, packing, split_kv, split_target=split_target,
        split_waves=split_waves, min_split_tokens=min_split_tokens,
        leaf_split_tokens=leaf_split_tokens,
    )  # fmt: skip


@settings(max_examples=150, deadline=None)
@given(
    batches(max_requests=40, max_pages=30, page_sizes=(1, 2, 5, 16), max_new_tokens=40),
    st.sampled_from(HEADS),
    st.sampled_from(PACKINGS),
    st.booleans(),
    st.booleans(),
    st.sampled_from([0, 8, 64, 132]),
    st.booleans(),
)
def test_larger_batches_and_long_queries(
    batch: Batch,
    heads: tuple[int, int],
    packing: str,
    split_kv: bool,
    skip_idle: bool,
    split_target: int,
    split_waves: bool,
) -> None:
    _compare(
        batch, heads, 128, 2, packing, split_kv, skip_idle=skip_idle, split_target=split_target,
        split_waves=split_waves,
    )  # fmt: skip


@settings(max_examples=100, deadline=None)
@given(batches(page_sizes=(1, 3, 16)), st.sampled_from(PACKINGS), st.booleans())
def test_int64_block_table(batch: Batch, packing: str, split_kv: bool) -> None:
    wide = Batch(
        block_table=batch.block_table.astype(np.int64),
        seq_lens=batch.seq_lens,
        qo_indptr=batch.qo_indptr,
        page_size=batch.page_size,
        num_pages=batch.num_pages,
    )
    _compare(wide, (32, 8), 128, 2, packing, split_kv)


@pytest.mark.parametrize("page_size", [16, 1])
@pytest.mark.parametrize("spec", PAT_TREES)
def test_pat_trees(spec: str, page_size: int) -> None:
    block_table, seq_lens = tree_batch(spec, page_size)
    b = len(seq_lens)
    decode = np.arange(b + 1, dtype=np.int32)
    for packing in PACKINGS:
        for split_kv, target in ((True, 132), (True, 0), (True, 1000), (False, 132), (True, 16)):
            batch = Batch(block_table, seq_lens, decode, page_size, int(block_table.max()) + 1)
            for waves in (False, True):
                _compare(
                    batch, (32, 8), 128, 2, packing, split_kv, split_target=target,
                    split_waves=waves,
                )  # fmt: skip
    # Some idle requests and some with several new tokens.
    qo = np.arange(b) % 3
    batch = Batch(
        block_table,
        seq_lens,
        np.concatenate(([0], np.cumsum(qo))).astype(np.int32),
        page_size,
        int(block_table.max()) + 1,
    )
    for packing in PACKINGS:
        _compare(batch, (16, 2), 64, 2, packing, True)


def _batch(rows: list[list[int]], lens: list[int], qo: list[int], page_size: int) -> Batch:
    width = max((len(r) for r in rows), default=0) + 1
    table = np.full((len(rows), width), 5, dtype=np.int32)
    for i, r in enumerate(rows):
        table[i, : len(r)] = r
    return Batch(
        block_table=table,
        seq_lens=np.asarray(lens, dtype=np.int32),
        qo_indptr=np.concatenate(([0], np.cumsum(qo))).astype(np.int32),
        page_size=page_size,
        num_pages=int(table.max(initial=0)) + 1,
    )


@pytest.mark.parametrize("packing", PACKINGS)
@pytest.mark.parametrize(
    "rows, lens, qo, page_size",
    [
        ([], [], [], 4),  # no requests
        ([[1, 2]], [0], [0], 4),  # nothing to attend to
        ([[7, 3, 5], [7, 3, 9], [7, 4]], [6, 5, 3], [1, 1, 1], 2),  # the forest docstring
        ([[4, 5, 6], [4, 5, 6], [4, 5, 9], [8, 1, 2]], [5, 6, 3, 2], [1, 2, 0, 1], 2),
        # id -1 past each row's pages (never read; it sorts like the end of a row)
        ([[3, 1, 4, -1], [3, -1], [3, 1, -1], [3, 1, 2, -1]], [3, 1, 2, 3], [1, 1, 1, 1], 1),
        ([[0, 1, 2, 3]] * 5, [4, 4, 3, 2, 1], [1, 1, 1, 1, 1], 1),  # nested prefixes
        ([[9, 256, 1], [9, 1, 256], [9, 255, 2], [9, 511]], [3, 3, 3, 2], [1, 1, 1, 1], 1),
    ],
)
def test_edge_cases(rows, lens, qo, page_size, packing: str) -> None:
    batch = _batch(rows, lens, qo, page_size)
    for split_kv in (True, False):
        for skip_idle in (True, False):
            _compare(batch, (8, 2), 64, 2, packing, split_kv, skip_idle=skip_idle)


def test_page_id_beyond_int32_is_rejected() -> None:
    table = np.array([[2**31 + 5, 1], [2**31 + 5, 2]], dtype=np.int64)
    shape = BatchShape(8, 2, 64, 2)
    args = (table, np.array([2, 2]), np.array([0, 1, 2]), 1, shape, tile_table(64), "naive", False)
    with pytest.raises(IndexError, match="beyond int32 range"):
        _python(*args)
    with pytest.raises(IndexError, match="beyond int32 range"):
        build_plan_native(*args)


def test_unknown_packing() -> None:
    batch = _batch([[1, 2]], [2], [1], 1)
    with pytest.raises(ValueError, match="unknown packing"):
        build_plan_native(
            batch.block_table,
            batch.seq_lens,
            batch.qo_indptr,
            1,
            BatchShape(8, 2, 64, 2),
            tile_table(64),
            "dense",
            True,
        )


def test_native_forest_describes_like_python() -> None:
    block_table, seq_lens = tree_batch("1,4,16_64,32,17", 4)
    indptr = np.arange(len(seq_lens) + 1)
    shape = BatchShape(32, 8, 128, 2)
    args = (block_table, seq_lens, indptr, 4, shape, tile_table(128), "memory", True)
    f_py = _python(*args)[0]
    f_nat = build_plan_native(*args)[0]
    assert f_nat.describe() == f_py.describe()
    assert f_nat.roots == f_py.roots
    np.testing.assert_array_equal(f_nat.depth(), f_py.depth())


def test_opcheck() -> None:
    table = torch.tensor([[7, 3, 5], [7, 3, 9], [7, 4, 0]], dtype=torch.int32)
    tiles = tile_table(64)
    args = (
        table,
        torch.tensor([6, 5, 3]),
        torch.tensor([0, 1, 3, 3]),
        2,
        8,
        2,
        64,
        2,
        list(tiles.m_sizes),
        [b for b, _ in tiles.n_by_kv_len],
        [n for _, n in tiles.n_by_kv_len],
        "memory",
        True,
        132,
        True,
    )
    torch.library.opcheck(torch.ops.prefixattn.build_plan.default, args)


def test_decreasing_qo_indptr_is_rejected() -> None:
    # PrefixAttention.plan rejects it before planning; the native builder checks it too.
    batch = _batch([[1, 2], [1, 3]], [2, 2], [1, 1], 1)
    with pytest.raises(ValueError, match="decreasing"):
        build_plan_native(
            batch.block_table,
            batch.seq_lens,
            np.array([0, 2, 1]),
            1,
            BatchShape(8, 2, 64, 2),
            tile_table(64),
            "per_query",
            True,
        )


def test_a_library_that_does_not_load_is_reported(tmp_path) -> None:
    """A library that fails to load gives one warning naming it, the package runs on the Python
    planner, and the kernels' status says why (in a fresh process: this one has the library)."""
    bad = tmp_path / "_C.so"
    bad.write_bytes(b"not a shared library")
    code = (
        "import warnings\n"
        "from prefixattn.runtime import library\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    print(library.load_library(), library.native_plan_available())\n"
        "print(len(w), str(w[0].message))\n"
        "print(library.kernels_status())\n"
    )
    env = dict(os.environ, PREFIXATTN_LIBRARY=str(bad))
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    lines = done.stdout.splitlines()
    assert lines[0] == "False False"
    assert lines[1].startswith("1 prefixattn: the compiled library is not available")
    assert str(bad) in lines[1]
    assert lines[2].startswith("not available: ")


@pytest.mark.parametrize("page_size", [16, 1])
@pytest.mark.parametrize("spec", ["1,16,256_2048,1024,1024", "1,4,16,512_1024,256,128,32"])
def test_reused_forest_packs_like_a_fresh_one(spec: str, page_size: int) -> None:
    """`reuse_forest=True` after a call on the same arrays (PrefixAttention.plan packs one
    batch with the default, the narrow and the one-wave tables) gives exactly the plan a fresh
    call gives, and the Python planner's; after a call on other arrays the op builds the forest
    anyway."""
    block_table, seq_lens = tree_batch(spec, page_size)
    decode = np.arange(len(seq_lens) + 1, dtype=np.int32)
    shape = BatchShape(32, 8, 128, 2)
    default = tile_table(128)
    narrow = default.narrow()
    assert narrow is not None
    for table in (narrow, default):
        build_plan_native(
            block_table, seq_lens, decode, page_size, shape, default, "memory", True, 132
        )
        reused = build_plan_native(
            block_table,
            seq_lens,
            decode,
            page_size,
            shape,
            table,
            "memory",
            True,
            132,
            reuse_forest=True,
        )
        fresh = build_plan_native(
            block_table, seq_lens, decode, page_size, shape, table, "memory", True, 132
        )
        _assert_same(fresh, reused)
        expected = _python(
            block_table, seq_lens, decode, page_size, shape, table, "memory", True, 132
        )
        _assert_same(expected, reused)
    # The previous call planned another batch: its forest is not taken.
    other_table, other_lens = tree_batch("2,8,16,256_256,256,32,32", page_size)
    other_decode = np.arange(len(other_lens) + 1, dtype=np.int32)
    build_plan_native(
        other_table, other_lens, other_decode, page_size, shape, default, "memory", True, 132
    )
    guarded = build_plan_native(
        block_table,
        seq_lens,
        decode,
        page_size,
        shape,
        narrow,
        "memory",
        True,
        132,
        reuse_forest=True,
    )
    _assert_same(
        _python(block_table, seq_lens, decode, page_size, shape, narrow, "memory", True, 132),
        guarded,
    )


@pytest.mark.parametrize("page_size", [16, 1])
@pytest.mark.parametrize("heads", [(32, 8), (64, 8), (16, 8), (32, 32)])
def test_plan_finishes_the_same_tokens_natively(page_size: int, heads: tuple[int, int]) -> None:
    """`PrefixAttention.plan` with the compiled planner (which also lets the leaf launch
    finish merged tokens, in the op) and with the Python one (`packer.finish_in_leaf`) gives
    the same arrays, finished tokens and tile choice on every PAT tree, for decode steps and
    for steps with idle requests and several new tokens."""
    hq, hkv = heads
    seen_finished = 0
    for spec in PAT_TREES:
        block_table, seq_lens = tree_batch(spec, page_size)
        b = len(seq_lens)
        qo = np.arange(b) % 3
        for indptr in (
            np.arange(b + 1, dtype=np.int32),
            np.concatenate(([0], np.cumsum(qo))).astype(np.int32),
        ):
            plans = []
            for native in (True, False):
                pa = prefixattn.PrefixAttention(hq, hkv, 128, page_size, device="cpu")
                pa.native_plan = native
                plans.append(pa.plan(block_table, seq_lens, indptr))
            nat, py = plans
            assert nat.num_finished == py.num_finished, spec
            assert nat.narrow == py.narrow and nat.tiles == py.tiles, spec
            for name in DEVICE_ARRAYS:
                torch.testing.assert_close(getattr(nat, name), getattr(py, name), msg=name)
            seen_finished += nat.num_finished
    assert seen_finished > 0  # the suite has plans whose leaf launch finishes tokens


@settings(max_examples=200, deadline=None)
@given(
    batches(max_requests=40, max_pages=30, page_sizes=(1, 2, 5, 16), max_new_tokens=6),
    st.sampled_from(HEADS),
    st.sampled_from(PACKINGS),
    st.sampled_from([1, 8, 64, 1056]),
)
def test_finishing_in_the_op_matches_finish_in_leaf(
    batch: Batch, heads: tuple[int, int], packing: str, leaf_warps: int
) -> None:
    """`finish_leaf_warps` applies `packer.finish_in_leaf` in the op: the same arrays and
    count on random forests (the items of 16-row tiles as leaf items), across the gate's
    leaf-warp counts."""
    shape = BatchShape(heads[0], heads[1], 128, 2)
    table = tile_table(128)
    args = (
        batch.block_table,
        batch.seq_lens,
        batch.qo_indptr,
        batch.page_size,
        shape,
        table,
        packing,
        True,
        132,
    )
    forest, host, tiles, tile_indptr, acc = _python(*args)
    leaf = np.zeros(len(host.kv_len), dtype=bool)
    for t, (m, _) in enumerate(tiles):
        if m == 16:
            leaf[tile_indptr[t] : tile_indptr[t + 1]] = True
    num_tokens = int(np.asarray(batch.qo_indptr)[-1])
    host, count = finish_in_leaf(host, leaf, num_tokens, shape.num_kv_heads, leaf_warps)
    nat = build_plan_native(*args, finish_leaf_warps=leaf_warps)
    assert nat[4].pop("num_finished") == count
    _assert_same((forest, host, tiles, tile_indptr, acc), nat)


@pytest.mark.parametrize("page_size", [16, 1])
@pytest.mark.parametrize(
    ("spec", "target"),
    [("1,256_4096,120", 132), ("1,128_1024,8", 66), ("1,64_4096,120", 132), ("1,32_1024,8", 24)],
)
def test_split_waves_natively(spec: str, target: int, page_size: int) -> None:
    # Batches where split_waves changes the plan: the op cuts the same parts as the packer.
    block_table, seq_lens = tree_batch(spec, page_size)
    decode = np.arange(len(seq_lens) + 1, dtype=np.int32)
    batch = Batch(block_table, seq_lens, decode, page_size, int(block_table.max()) + 1)
    shape = BatchShape(32, 8, 128, 2)
    args = (
        block_table,
        seq_lens,
        decode,
        page_size,
        shape,
        tile_table(128),
        "memory",
        True,
        target,
    )
    plain = build_plan_native(*args)
    waves = build_plan_native(*args, split_waves=True)
    assert len(waves[1].kv_len) < len(plain[1].kv_len)
    _compare(batch, (32, 8), 128, 2, "memory", True, split_target=target, split_waves=True)


@pytest.mark.parametrize("floor", [256, 64, 16, 5])
@pytest.mark.parametrize("spec", ["1_1408", "4_1408", "16_1408", "1_8192", "1,4_1024,384"])
def test_split_floor_natively(spec: str, floor: int) -> None:
    # Small decode batches (leaf chunks alone), where the split floor decides the parts: the
    # op cuts the same parts as the packer, and no part is shorter than the floor.
    block_table, seq_lens = tree_batch(spec, 16)
    decode = np.arange(len(seq_lens) + 1, dtype=np.int32)
    batch = Batch(block_table, seq_lens, decode, 16, int(block_table.max()) + 1)
    _compare(batch, (32, 8), 128, 2, "memory", True, split_waves=True, leaf_split_tokens=floor)
    plan = build_plan_native(
        block_table, seq_lens, decode, 16, BatchShape(32, 8, 128, 2), tile_table(128), "memory",
        True, 132, split_waves=True, leaf_split_tokens=floor,
    )  # fmt: skip
    kv_len = plan[1].kv_len
    assert int(kv_len.min()) >= min(max(floor, 16), int(seq_lens.min()))


@pytest.mark.parametrize("leaf_floor", [64, 256])
def test_leaf_floor_only_where_every_chunk_is_a_leaf_chunk(leaf_floor: int) -> None:
    # 10 requests under a 4096-token prefix: the prefix's 40 rows take a 64-row tile, so the
    # general floor (256) decides and the leaf floor changes nothing; 4 requests under a
    # 1024-token prefix (16 rows, leaf chunks alone) are cut at the leaf floor.
    shape, tiles = BatchShape(32, 8, 128, 2), tile_table(128)
    items = {}
    for spec in ("1,10_4096,416", "1,4_1024,384"):
        block_table, seq_lens = tree_batch(spec, 1 if spec.startswith("1,10") else 16)
        decode = np.arange(len(seq_lens) + 1, dtype=np.int32)
        ps = 1 if spec.startswith("1,10") else 16
        plan = build_plan_native(
            block_table, seq_lens, decode, ps, shape, tiles, "memory", True, 132,
            split_waves=True, leaf_split_tokens=leaf_floor,
        )  # fmt: skip
        items[spec] = len(plan[1].kv_len)
    assert items["1,10_4096,416"] == 16
    assert items["1,4_1024,384"] == (40 if leaf_floor == 64 else 8)


def test_split_floor_must_be_positive() -> None:
    block_table, seq_lens = tree_batch("1_1408", 16)
    decode = np.arange(2, dtype=np.int32)
    with pytest.raises(ValueError, match="min_split_tokens"):
        build_plan_native(
            block_table, seq_lens, decode, 16, BatchShape(32, 8, 128, 2), tile_table(128),
            "memory", True, 132, min_split_tokens=0,
        )  # fmt: skip
    with pytest.raises(ValueError, match="leaf_split_tokens"):
        build_plan_native(
            block_table, seq_lens, decode, 16, BatchShape(32, 8, 128, 2), tile_table(128),
            "memory", True, 132, leaf_split_tokens=0,
        )  # fmt: skip
