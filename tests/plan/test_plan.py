"""Plan invariants: coverage, merge layout, tiles, byte accounting, the PAT suite."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from conftest import NATIVE_OR_PYTHON, Batch, batches, check_coverage, check_merge_layout
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixattn import PAT_TREES, PrefixAttention, tree_batch
from prefixattn.plan.packing import MIN_SPLIT_TOKENS, WAVE_PAIR_TOKENS, fill_waves, launch_makespan
from prefixattn.plan.planner import DEVICE_ARRAYS

HEADS = [(32, 32), (16, 8), (32, 8), (64, 8)]
PACKINGS = ("memory", "naive", "per_query")


def _plan(batch: Batch, hq: int, hkv: int, packing: str, split_kv: bool, head_dim: int = 64):
    pa = PrefixAttention(hq, hkv, head_dim, batch.page_size)
    return pa.plan(
        batch.block_table, batch.seq_lens, batch.qo_indptr, packing=packing, split_kv=split_kv
    )


def _default_table(pa: PrefixAttention) -> PrefixAttention:
    """``pa`` planning with its tile table alone (no narrow alternative plan)."""
    pa.tiles = dataclasses.replace(pa.tiles, narrow_m_sizes=())
    return pa


def _item_multiset(plan) -> list[tuple[int, ...]]:
    h = plan.host
    rows = np.diff(h.q_indptr)
    pages = -(-h.kv_len.astype(np.int64) // plan.page_size)
    return sorted(
        zip(h.kv_start.tolist(), h.kv_len.tolist(), rows.tolist(), pages.tolist(), strict=True)
    )


@settings(max_examples=150, deadline=None)
@given(
    batches(),
    st.sampled_from([(4, 4), (8, 2), (14, 2), (16, 1), (12, 4)]),
    st.sampled_from(PACKINGS),
    st.booleans(),
)
def test_every_visible_pair_is_covered_once(
    batch: Batch, heads: tuple[int, int], packing: str, split_kv: bool
) -> None:
    plan = _plan(batch, *heads, packing, split_kv)
    check_coverage(plan, batch)
    check_merge_layout(plan)


def test_heights_up_to_worked_example() -> None:
    table = PrefixAttention(32, 8, 128, 16).tiles  # sm90, head_dim 128
    assert [table.heights_up_to(r) for r in (0, 4, 16)] == [(16,)] * 3
    assert table.heights_up_to(17) == table.heights_up_to(32) == (16, 32, 64)  # narrow's 64
    assert table.heights_up_to(33) == table.heights_up_to(10_000) == (16, 32, 64, 128)
    assert PrefixAttention(8, 8, 256, 16).tiles.heights_up_to(40) == (16, 32, 64)
    # Remembered per table: a table of other heights, equal row counts, its own answers, the
    # same as computed afresh.
    import dataclasses

    other = dataclasses.replace(table, m_sizes=(16, 64, 128), narrow_m_sizes=(16, 32))
    assert other.heights_up_to(17) == (16, 32, 64) and other.heights_up_to(65) == (16, 32, 64, 128)
    for t in (table, other):
        assert all(t.heights_up_to(r) == t._heights_up_to(r) for r in (1, 17, 33, 65, 129))
    assert table.narrow() is table.narrow() and other.narrow() != table.narrow()


def test_fixed_launches_by_tokens() -> None:
    # Bits 0-3: the 16-, 32-, 64- and 128-row kernels; bit 4: the merge.
    pa = PrefixAttention(32, 8, 128, 16)
    assert [pa._fixed_launches(t) for t in (1, 4, 5, 8, 9, 256)] == [
        0b10001,
        0b10001,
        0b10111,
        0b10111,
        0b11111,
        0b11111,
    ]


@settings(max_examples=100, deadline=None)
@given(
    batches(max_requests=40, max_pages=30),
    st.sampled_from([(32, 8), (8, 8), (28, 4), (64, 8)]),
    st.sampled_from(PACKINGS),
    st.booleans(),
    st.booleans(),
)
def test_plans_keep_to_the_heights_of_their_tokens(
    batch: Batch, heads: tuple[int, int], packing: str, split_kv: bool, one_wave: bool
) -> None:
    # What a CUDA graph captured at T tokens launches (PrefixAttention._fixed_launches)
    # covers every plan of at most T tokens; planning checks it too (it raises otherwise).
    pa = PrefixAttention(*heads, 128, batch.page_size)
    pa.one_launch_in_one_wave = one_wave
    plan = pa.plan(batch.block_table, batch.seq_lens, batch.qo_indptr, packing=packing,
                   split_kv=split_kv)  # fmt: skip
    rows = int(batch.qo_indptr[-1]) * heads[0] // heads[1]
    assert {m for m, _ in plan.tiles} <= set(pa.tiles.heights_up_to(rows))


def test_a_table_changed_after_fixed_launches_raises() -> None:
    import dataclasses as dc

    pa = PrefixAttention(32, 8, 128, 16)
    pa._fixed_launches(2)  # as a graph capture of 2 tokens does
    pa.tiles = dc.replace(pa.tiles, m_sizes=(128,), narrow_m_sizes=())  # one 128-row tile
    table, lens = tree_batch("1,2_64,100", 16)
    with pytest.raises(RuntimeError, match="`tiles` changed after a fixed-grid run"):
        pa.plan(table, lens)


@settings(max_examples=100, deadline=None)
@given(batches(max_requests=40, max_pages=30), st.sampled_from(PACKINGS), st.booleans())
def test_tiles_fit_their_items(batch: Batch, packing: str, split_kv: bool) -> None:
    pa = PrefixAttention(32, 8, 128, batch.page_size)
    args = (batch.block_table, batch.seq_lens, batch.qo_indptr)
    unified = pa.plan(*args, packing=packing, split_kv=split_kv)
    pa.one_launch_in_one_wave = False
    plan = pa.plan(*args, packing=packing, split_kv=split_kv)
    top = max((m for m, _ in plan.tiles), default=0)
    assert pa.split_target is not None  # set from the device by the first plan
    one_wave = plan.num_work_items * 8 <= pa.split_target
    for p in (plan, unified):
        h = p.host
        rows = np.diff(h.q_indptr) * 4
        assert (rows <= pa.tiles.max_rows).all()
        for t, (m, n) in enumerate(p.tiles):
            items = range(p.tile_indptr[t], p.tile_indptr[t + 1])
            assert len(items) > 0
            for w in items:
                assert h.tile_id[w] == t
                table = pa.tiles.narrow() if p.narrow else pa.tiles
                assert table is not None
                m_own, n_own = table.select(int(rows[w]), int(h.kv_len[w]))
                # In a one-wave plan every item takes the largest height in use.
                assert (m, n) == (top if p is unified and one_wave else m_own, n_own)
            lengths = h.kv_len[p.tile_indptr[t] : p.tile_indptr[t + 1]]
            assert (np.diff(lengths) <= 0).all(), "longest items first inside a tile group"
    # Only the tile heights differ: the same items, pages, slots and partials.
    assert _item_multiset(unified) == _item_multiset(plan)
    assert unified.num_partials == plan.num_partials


@settings(max_examples=150, deadline=None)
@given(batches(max_requests=12, decode_only=True), st.booleans())
def test_naive_reads_each_distinct_page_once(batch: Batch, split_kv: bool) -> None:
    # With every node's query rows inside one tile (12 requests x group 4 <= 128 rows).
    plan = _plan(batch, 8, 2, "naive", split_kv)
    assert plan.kv_bytes == plan.distinct_kv_bytes
    pages = plan.host.kv_pages
    assert len(np.unique(pages)) == len(pages)
    used = -(-batch.seq_lens.astype(np.int64) // batch.page_size)
    mask = np.arange(batch.block_table.shape[1])[None, :] < used[:, None]
    assert set(pages.tolist()) == set(batch.block_table[mask].tolist())


@settings(max_examples=150, deadline=None)
@given(batches(max_requests=30, max_pages=20), st.sampled_from(HEADS), st.booleans())
def test_memory_never_reads_more_kv_than_per_query(
    batch: Batch, heads: tuple[int, int], split_kv: bool
) -> None:
    memory = _plan(batch, *heads, "memory", split_kv, head_dim=128)
    per_query = _plan(batch, *heads, "per_query", split_kv, head_dim=128)
    assert memory.kv_bytes <= per_query.kv_bytes
    assert (
        per_query.kv_bytes == per_query.query_centric_kv_bytes
        or not split_kv
        or (batch.qo_lens.max(initial=0) > 1)
    )


@pytest.mark.parametrize("page_size", [16, 1])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("split_kv", [True, False])
def test_memory_packing_moves_fewest_bytes_on_pat_suite(
    page_size: int, heads: tuple[int, int], split_kv: bool
) -> None:
    # One tile table for every packing (the narrow alternative is chosen per plan).
    pa = _default_table(PrefixAttention(*heads, 128, page_size))
    # Every long chunk cut by the same length: with a split target the cut depends on the
    # launch's balance, so a packing with fewer, longer items may be cut where another is not.
    pa.split_target = 0
    for tree in PAT_TREES:
        table, lens = tree_batch(tree, page_size)
        total = {
            p: pa.plan(table, lens, packing=p, split_kv=split_kv).total_bytes for p in PACKINGS
        }
        assert total["memory"] <= total["naive"], (tree, total)
        assert total["memory"] <= total["per_query"], (tree, total)


def test_shared_prefix_is_read_once_per_row_chunk() -> None:
    # 1,4,64_1024,256,128 with 32/8 heads: 64 requests x group 4 = 256 rows on the root.
    table, lens = tree_batch("1,4,64_1024,256,128", 16)
    plan = _default_table(PrefixAttention(32, 8, 128, 16)).plan(table, lens, split_kv=False)
    root_pages = set(table[0, :64].tolist())
    reads = sum(p in root_pages for p in plan.host.kv_pages.tolist())
    assert reads == 2 * 64  # two 128-row chunks, each reads the 64 root pages once
    assert plan.query_centric_kv_bytes / plan.kv_bytes > 7


def test_long_kv_split_bounds_item_length() -> None:
    table, lens = tree_batch("1,10_4096,416", 16)
    pa = PrefixAttention(32, 8, 128, 16)
    split = pa.plan(table, lens, split_kv=True)
    whole = pa.plan(table, lens, split_kv=False)
    assert whole.host.kv_len.max() == 4096
    node_mean = (4096 + 10 * 416) / 11
    assert split.host.kv_len.max() <= max(node_mean, MIN_SPLIT_TOKENS) + 16
    assert split.kv_bytes == whole.kv_bytes
    assert split.num_work_items > whole.num_work_items


def _same_arrays(a, b) -> bool:
    return all(
        np.array_equal(getattr(a.host, f), getattr(b.host, f)) for f in a.host.__dataclass_fields__
    )


def test_split_target_leaves_busy_gpus_unsplit() -> None:
    # 1024 requests x group 4 on a 2048-token root: 32 row chunks x 8 KV heads = 256 pairs,
    # more than half of 132: nothing is split, exactly as with split_kv=False.
    table, lens = tree_batch("1,1024_2048,32", 16)
    pa = PrefixAttention(32, 8, 128, 16)
    capped = pa.plan(table, lens)
    assert pa.split_target == 132  # a CPU plan uses DEFAULT_SPLIT_TARGET
    whole = pa.plan(table, lens, split_kv=False)
    assert _same_arrays(capped, whole)
    pa.split_target = 0  # split every long item: the root is cut
    every = pa.plan(table, lens)
    assert every.num_work_items > whole.num_work_items
    pa.split_target = 10**9  # a target no batch fills behaves like 0
    pa.one_launch_in_one_wave = False  # (which would otherwise unify this small plan's tiles)
    assert _same_arrays(pa.plan(table, lens), every)


def test_split_target_cuts_only_chunks_that_leave_sms_idle() -> None:
    # 256 requests x group 4 on a 4096-token root: 8 row chunks x 8 KV heads = 64 pairs alone
    # in the 128-row launch, whose share per SM is 64 * 4096 / 132 = 1986 tokens. At a target
    # of 132 a pair's 4096 tokens are more than twice that: each chunk is cut into
    # ceil(4096 / (1986 / 2)) = 5 parts (16 with split_target=0, parts of 256 tokens). At 128
    # SMs a pair holds exactly twice the share: not cut. (The split rule alone: without
    # split_waves, which would then take fewer parts; below.)
    table, lens = tree_batch("1,256_4096,32", 16)
    pa = PrefixAttention(32, 8, 128, 16)
    pa.split_waves = False

    def root_items(plan) -> list[int]:
        h = plan.host
        return sorted(int(n) for s, n in zip(h.kv_start, h.kv_len, strict=True) if s < 4096)

    assert root_items(pa.plan(table, lens)) == sorted([816, 816, 832, 816, 816] * 8)
    pa.split_target = 0
    assert root_items(pa.plan(table, lens)) == [256] * (8 * 16)
    for target in (128, 16):
        pa.split_target = target
        assert root_items(pa.plan(table, lens)) == [4096] * 8


def test_split_waves_fills_whole_waves() -> None:
    # The plan above: 5 parts per root chunk, 320 pairs in 3 rounds of 107 blocks. With
    # split_waves each chunk gets 2 parts of 2048 tokens: 128 pairs, one round.
    table, lens = tree_batch("1,256_4096,32", 16)
    pa = PrefixAttention(32, 8, 128, 16)
    pa.split_target = 132
    pa.split_waves = True

    def root_items(plan) -> list[int]:
        h = plan.host
        return sorted(int(n) for s, n in zip(h.kv_start, h.kv_len, strict=True) if s < 4096)

    waves = pa.plan(table, lens)
    assert root_items(waves) == [2048] * 16
    # Leaves and everything below the rule's split stay as they were.
    pa.split_waves = False
    plain = pa.plan(table, lens)

    def leaf_items(plan) -> list[tuple[int, int]]:
        h = plan.host
        return sorted(
            (int(s), int(n)) for s, n in zip(h.kv_start, h.kv_len, strict=True) if s >= 4096
        )

    assert leaf_items(plain) == leaf_items(waves)
    # Where the rule cuts nothing, nothing changes.
    for target in (128, 16):
        pa.split_target = target
        pa.split_waves = False
        unsplit = pa.plan(table, lens)
        pa.split_waves = True
        assert _same_arrays(pa.plan(table, lens), unsplit)


def test_launch_makespan_worked_example() -> None:
    lens = np.full(8, 4096)
    assert launch_makespan(lens, np.full(8, 2), 8, 132, 16) == 2048 + WAVE_PAIR_TOKENS
    # 5 parts of 51 or 52 pages: 320 pairs, 3 rounds on 107 blocks.
    assert launch_makespan(lens, np.full(8, 5), 8, 132, 16) == 3232
    assert launch_makespan(lens, np.full(8, 1), 8, 132, 16) == 4096 + WAVE_PAIR_TOKENS
    parts = fill_waves(np.full(8, 5), lens, np.zeros(8, dtype=np.int64), np.full(8, 132), 8, 16)
    assert parts.tolist() == [2] * 8
    # Chunks the rule left whole are never cut by it.
    mixed = fill_waves(np.array([5, 1]), np.array([4096, 4096]), np.zeros(2, dtype=np.int64),
                       np.full(2, 4), 8, 16)  # fmt: skip
    assert mixed[1] == 1 and 1 <= mixed[0] <= 5


def test_one_wave_plan_runs_as_one_launch() -> None:
    # 10 requests x group 4 under a 4096-token root: 10 leaf items (16-row tiles) and 6 root
    # parts (40 rows, 688 tokens: the 128-row tile by the wide rule), 16 items x 8 KV heads =
    # 128 pairs <= 132: one wave. Every item takes the 128-row tile; the items themselves do
    # not change.
    table, lens = tree_batch("1,10_4096,416", 16)
    pa = _default_table(PrefixAttention(32, 8, 128, 16))
    one = pa.plan(table, lens)
    pa.one_launch_in_one_wave = False
    per_height = pa.plan(table, lens)
    assert sorted({m for m, _ in per_height.tiles}) == [16, 128]
    assert sorted({m for m, _ in one.tiles}) == [128]
    assert one.num_ctas == per_height.num_ctas == 128
    assert _item_multiset(one) == _item_multiset(per_height)
    assert one.num_partials == per_height.num_partials
    # More pairs than one wave (or a target of 0): tile heights stay per item.
    pa.one_launch_in_one_wave = True
    pa.split_target = 127
    assert sorted({m for m, _ in pa.plan(table, lens).tiles}) == [16, 128]
    table, lens = tree_batch("1,256_256,32", 16)
    pa = PrefixAttention(32, 8, 128, 16)
    big = pa.plan(table, lens)
    assert big.num_ctas > 132 and len({m for m, _ in big.tiles}) > 1


@pytest.mark.parametrize("native", NATIVE_OR_PYTHON)
@pytest.mark.parametrize(
    ("spec", "heads"),
    [
        ("8,16,32,256_512,512,256,32", (32, 8)),
        ("4,16,256,512_512,32,128,32", (16, 8)),
        ("1,2,64_1024,256,256", (16, 8)),
    ],
)
def test_wide_items_take_the_largest_tile(native: bool, spec: str, heads: tuple[int, int]) -> None:
    # Items of more than 32 rows and at least 256 KV tokens run on the 128-row tile (head_dim
    # 128); shorter ones, and items of at most 32 rows, keep the smallest tile that fits.
    # Without a split target (no split rule, which counts pairs per tile height) the rule
    # changes tile heights only: the plan has the same items.
    table, lens = tree_batch(spec, 16)
    pa = _default_table(PrefixAttention(*heads, 128, 16))
    pa.native_plan = native
    pa.one_launch_in_one_wave = False
    assert (pa.tiles.wide_rows, pa.tiles.wide_kv_len) == (32, 256)
    plan = pa.plan(table, lens)
    rows = np.diff(plan.host.q_indptr) * (heads[0] // heads[1])
    seen = set()
    for t, (m, _) in enumerate(plan.tiles):
        for w in range(plan.tile_indptr[t], plan.tile_indptr[t + 1]):
            r, n = int(rows[w]), int(plan.host.kv_len[w])
            wide = r > 32 and n >= 256
            assert m == (128 if wide else min(x for x in (16, 32, 64, 128) if x >= r)), (r, n, m)
            seen.add((wide, r > 32))
    assert (True, True) in seen and (False, False) in seen
    no_wide = _default_table(PrefixAttention(*heads, 128, 16))
    no_wide.native_plan = native
    no_wide.one_launch_in_one_wave = False
    no_wide.tiles = dataclasses.replace(no_wide.tiles, wide_kv_len=0)
    pa.split_target = no_wide.split_target = 0
    plain, widened = no_wide.plan(table, lens), pa.plan(table, lens)
    assert _item_multiset(plain) == _item_multiset(widened)
    assert plain.num_partials == widened.num_partials


@pytest.mark.parametrize("native", NATIVE_OR_PYTHON)
@pytest.mark.parametrize(
    ("spec", "heads", "narrow"),
    [
        ("1,256_256,32", (32, 8), True),
        ("2,8,16,256_256,256,32,32", (32, 8), True),
        ("1,10_4096,416", (32, 8), True),
        ("1,1024_2048,32", (64, 8), False),
        ("1,10_4096,416", (64, 8), False),
        ("256_1024", (32, 8), False),
    ],
)
def test_narrow_plan_where_it_moves_few_more_bytes(
    native: bool, spec: str, heads: tuple[int, int], narrow: bool
) -> None:
    # At head_dim 128 the planner also plans with 16- and 64-row tiles alone and takes that
    # plan where its KV and partial-row bytes are at most 1.25 times those of the default
    # table's plan: small roots (cheap to read twice) yes; a 2048-token root under 8192 rows,
    # or a 4096-token root under 80 rows, no.
    table, lens = tree_batch(spec, 16)
    pa = PrefixAttention(*heads, 128, 16)
    pa.native_plan = native
    assert pa.tiles.narrow_m_sizes == (16, 64) and pa.tiles.narrow_traffic == 1.25
    plan = pa.plan(table, lens)
    default = _default_table(PrefixAttention(*heads, 128, 16))
    default.native_plan = native
    base = default.plan(table, lens)
    alone = PrefixAttention(*heads, 128, 16)
    alone.native_plan = native
    narrow_table = pa.tiles.narrow()
    assert narrow_table is not None
    alone.tiles = narrow_table
    alt = alone.plan(table, lens)
    if {m for m, _ in base.tiles} == {16}:  # the same plan either way: not built twice
        assert not narrow and alt.tiles == base.tiles
    else:
        moved = alt.kv_bytes + alt.partial_bytes
        assert (moved <= 1.25 * (base.kv_bytes + base.partial_bytes)) == narrow
    assert plan.narrow == narrow and not base.narrow and not alt.narrow
    expect = alt if narrow else base
    assert plan.tiles == expect.tiles and _item_multiset(plan) == _item_multiset(expect)
    assert not narrow or {m for m, _ in plan.tiles} <= {16, 64}


@pytest.mark.parametrize("native", NATIVE_OR_PYTHON)
def test_one_wave_plan_is_exact(native: bool) -> None:
    # The unified plan still computes attention exactly (CPU reference).
    table, lens = tree_batch("1,10_300,41", 16)
    pa = PrefixAttention(32, 8, 64, 16, dtype=torch.float64)
    pa.native_plan = native
    pa.one_launch_in_one_wave = False
    assert len({m for m, _ in pa.plan(table, lens).tiles}) > 1
    pa.one_launch_in_one_wave = True
    plan = pa.plan(table, lens)
    assert len({m for m, _ in plan.tiles}) == 1
    gen = torch.Generator().manual_seed(0)
    pages = int(table.max()) + 1
    k = torch.randn(pages, 16, 8, 64, generator=gen, dtype=torch.float64)
    v = torch.randn(pages, 16, 8, 64, generator=gen, dtype=torch.float64)
    q = torch.randn(len(lens), 32, 64, generator=gen, dtype=torch.float64)
    out = pa.run(q, k, v)
    for b, n in enumerate(lens.tolist()):
        idx = torch.arange(n)
        blocks = torch.as_tensor(table[b])[idx // 16].long()
        kb = k[blocks, idx % 16].repeat_interleave(4, dim=1)  # [n, 32, 64]
        vb = v[blocks, idx % 16].repeat_interleave(4, dim=1)
        w = torch.softmax(torch.einsum("hd,nhd->hn", q[b], kb) / 8.0, dim=-1)
        torch.testing.assert_close(out[b], torch.einsum("hn,nhd->hd", w, vb))


def test_plan_arrays_are_int32_on_device() -> None:
    table, lens = tree_batch("2,8_64,32", 16)
    plan = PrefixAttention(8, 2, 64, 16).plan(torch.from_numpy(table), torch.from_numpy(lens))
    for name in DEVICE_ARRAYS:
        t = getattr(plan, name)
        assert t.dtype == torch.int32 and t.device.type == "cpu", name
        np.testing.assert_array_equal(t.numpy(), getattr(plan.host, name))
    assert plan.num_ctas == plan.num_work_items * 2
    import dataclasses

    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.kv_bytes = 0  # type: ignore[misc]


def test_variant_bounds_follow_tile_groups():
    from prefixattn.plan.layout import (
        COUNTS,
        COUNTS_LEN,
        PACKED_HEADS,
        VARIANT_ROWS,
        variant_bounds,
    )

    assert variant_bounds(((16, 64), (16, 128), (128, 128)), (0, 3, 5, 6)) == [0, 5, 5, 5, 6]
    assert variant_bounds((), (0,)) == [0, 0, 0, 0, 0]
    with pytest.raises(ValueError, match="tile height 48"):
        variant_bounds(((48, 64),), (0, 2))
    # A plan's counts end with the bounds: items of height VARIANT_ROWS[v] are
    # counts[6 + v] .. counts[7 + v], and the groups' heights agree with them.
    pa = PrefixAttention(32, 8, 128, 16)
    table, lens = tree_batch("1,4,64_1024,256,128", 16)
    plan = pa.plan(table, lens)
    counts = plan.counts.tolist()
    assert len(counts) == COUNTS_LEN
    bounds = counts[len(COUNTS) : PACKED_HEADS]
    assert bounds[0] == 0 and bounds[-1] == plan.num_work_items
    for t, (m, _) in enumerate(plan.tiles):
        v = VARIANT_ROWS.index(m)
        assert bounds[v] <= plan.tile_indptr[t] and plan.tile_indptr[t + 1] <= bounds[v + 1]


@pytest.mark.parametrize("spec", ["1,256_4096,64", "1,4,16,64_1024,512,256,31", "64_8000"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("split_target", [132, 0])
def test_decode_reservation_holds_decode_plans(spec, page_size, split_target):
    from prefixattn import decode_reservation

    table, lens = tree_batch(spec, page_size)
    b = len(lens)
    pa = PrefixAttention(32, 8, 128, page_size)
    pa.split_target = split_target
    plan = pa.plan(table, lens)
    sizes = decode_reservation(b, b, int(lens.max()), page_size)
    assert plan.num_work_items <= sizes["num_work_items"]
    assert len(plan.host.q_tokens) <= sizes["num_slots"]
    assert len(plan.host.kv_pages) <= sizes["num_pages"]
    assert plan.num_partials <= sizes["num_slots"]
    assert plan.num_tokens <= sizes["num_tokens"]


def test_captured_buffers_guard(monkeypatch: pytest.MonkeyPatch) -> None:
    from prefixattn import CapturedBuffers

    pa = PrefixAttention(8, 2, 64, 16)
    generation = [0]
    monkeypatch.setattr(PrefixAttention, "buffers_generation", property(lambda s: generation[0]))
    guard = CapturedBuffers("Do X.")
    guard.check(pa)  # nothing captured yet: nothing to protect
    guard.pin(pa)
    guard.pin(pa)  # a second capture on the same buffers
    table, lens = tree_batch("1,4_64,16", 16)
    pa.plan(table, lens)
    guard.check(pa)
    generation[0] = 1  # a plan moved the buffers
    with pytest.raises(RuntimeError, match=r"plan \(4 tokens.*generation 0 -> 1.*Do X\."):
        guard.check(pa)
    with pytest.raises(RuntimeError, match=r"between two CUDA graph captures.*Do X\."):
        guard.pin(pa)


def test_packed_heads_fill_the_smallest_tile():
    from prefixattn.plan.layout import packed_heads

    assert packed_heads(4, 8) == 4  # one decode token, group 4: 16 rows
    assert packed_heads(3, 8) == 4  # 12 rows
    assert packed_heads(8, 8) == 2
    assert packed_heads(1, 32) == 16  # MHA: 16 heads of one row each
    assert packed_heads(5, 6) == 2  # 10 rows; 4 heads would not divide 6
    assert packed_heads(4, 6) == 2
    assert packed_heads(2, 1) == 1  # one KV head
    assert packed_heads(9, 8) == 1
    assert packed_heads(16, 8) == 1
    assert packed_heads(0, 8) == 1  # no 16-row items
    # Packing stops before the launch would run fewer pairs than asked for.
    assert packed_heads(4, 8, num_items=256, min_pairs=132) == 4  # 512 pairs
    assert packed_heads(4, 8, num_items=64, min_pairs=132) == 2  # 256 pairs; 4 heads: 128
    assert packed_heads(4, 8, num_items=8, min_pairs=132) == 1  # 64 pairs already
    assert packed_heads(1, 32, num_items=64, min_pairs=132) == 8  # 256 pairs
    for rows in range(1, 17):
        for kv_heads in (1, 2, 3, 4, 6, 8, 12, 32):
            h = packed_heads(rows, kv_heads)
            assert h * rows <= 16 or h == 1
            assert kv_heads % h == 0 and h & (h - 1) == 0
            # the largest such power of two
            assert not (2 * h * rows <= 16 and kv_heads % (2 * h) == 0)


@pytest.mark.parametrize(
    ("heads", "spec", "expected"),
    [
        ((32, 8), "1,256_1024,32", 4),  # one-token leaves in 16-row tiles: group 4 -> 4 heads
        ((64, 8), "1,256_1024,32", 2),  # group 8
        ((32, 32), "1,256_1024,32", 16),  # group 1: 16 heads of one row each
        ((16, 1), "1,256_1024,32", 1),  # one KV head (group 16: a leaf fills the tile)
    ],
)
def test_plan_counts_hold_packed_heads(heads, spec, expected):
    """The plan records how many KV heads a pair of the 16-row kernel covers: the largest
    power of two whose rows (the largest 16-row item's rows each) fit in 16 and that divides
    the KV heads; `pack_heads = False` keeps one."""
    from prefixattn.plan.layout import PACKED_HEADS, VARIANT_ROWS, packed_heads

    hq, hkv = heads
    pa = PrefixAttention(hq, hkv, 128, 16)
    table, lens = tree_batch(spec, 16)
    plan = pa.plan(table, lens)
    counts = plan.counts.tolist()
    host = plan.host
    bounds = counts[PACKED_HEADS - len(VARIANT_ROWS) - 1 : PACKED_HEADS]
    rows = np.diff(host.q_indptr)[bounds[0] : bounds[1]] * (hq // hkv)
    assert len(rows) > 0
    assert counts[PACKED_HEADS] == packed_heads(int(rows.max()), hkv, len(rows), 132)
    assert counts[PACKED_HEADS] == expected
    pa.pack_heads = False
    assert pa.plan(table, lens).counts.tolist()[PACKED_HEADS] == 1


@pytest.mark.parametrize("spec", ["1_32768", "2_32768", "8_32768", "64_4096"])
@pytest.mark.parametrize("heads", [(32, 8), (32, 32)])
def test_few_long_leaf_requests_fill_the_warps(spec, heads):
    """A few long decode requests without sharing run in the leaf kernel, one warp per (item,
    KV head) pair, 8 pairs per SM: their chunks are cut (whatever the mean node length, which
    is the whole request here) until the launch holds at least half of 8 x 132 pairs, in
    parts of at least LEAF_SPLIT_TOKENS tokens (the leaf floor: every chunk is a leaf
    chunk). Packing of heads then follows packed_heads."""
    from prefixattn.plan.layout import LEAF_PAIRS_PER_SM, PACKED_HEADS, packed_heads
    from prefixattn.plan.packing import LEAF_SPLIT_TOKENS, SPLIT_SLACK

    hq, hkv = heads
    pa = PrefixAttention(hq, hkv, 128, 16)
    pa.split_target = 132
    table, lens = tree_batch(spec, 16)
    plan = pa.plan(table, lens)
    h = plan.host
    assert {m for m, _ in plan.tiles} == {16}
    pairs = len(h.kv_len) * hkv
    assert (
        pairs >= LEAF_PAIRS_PER_SM * 132 // SPLIT_SLACK
        or int(h.kv_len.max()) < 2 * LEAF_SPLIT_TOKENS
    )
    assert int(h.kv_len.min()) >= LEAF_SPLIT_TOKENS
    assert plan.counts.tolist()[PACKED_HEADS] == packed_heads(hq // hkv, hkv, len(h.kv_len), 132)
    # head_dim 256 runs its 16-row tiles on the CUDA-core kernel, one pair per SM: cut no more.
    pa256 = PrefixAttention(hq, hkv, 256, 16)
    pa256.split_target = 132
    assert len(pa256.plan(table, lens).host.kv_len) <= len(h.kv_len)


@pytest.mark.parametrize(
    "spec",
    ["1,256_256,32", "1,4,16,512_1024,256,128,32", "1,16,32,64,256,1024_256,128,64,32,32,32"],
)
@pytest.mark.parametrize("heads", [(32, 8), (16, 8), (64, 8)])
def test_leaf_items_finish_their_merged_tokens(spec: str, heads: tuple[int, int]) -> None:
    table, lens = tree_batch(spec, 16, seed=0)
    pa = PrefixAttention(*heads, 128, 16)
    pa.split_target = 132
    plan = pa.plan(table, lens)
    check_merge_layout(plan)
    if spec == "1,256_256,32":
        # Every request's leaf is a 16-row item beside the 128-row root: all tokens finish.
        assert plan.num_finished == plan.num_merge_tokens == 256
    assert int(plan.counts[-1]) == plan.num_merge_tokens - plan.num_finished
    pa.finish_in_leaf = False
    plain = pa.plan(table, lens)
    check_merge_layout(plain)
    assert plain.num_finished == 0 and int(plain.counts[-1]) == plain.num_merge_tokens
    # The same items, slots and partial rows; only the merge order and the markers differ.
    assert _item_multiset(plan) == _item_multiset(plain)
    np.testing.assert_array_equal(np.sort(plan.host.merge_tokens), plain.host.merge_tokens)
    assert plan.num_partials == plain.num_partials


def test_no_finishing_without_the_leaf_kernel() -> None:
    # head_dim 256 has no leaf kernel: every merged token goes through the merge launch.
    table, lens = tree_batch("1,256_256,32", 16, seed=0)
    pa = PrefixAttention(32, 8, 256, 16)
    plan = pa.plan(table, lens)
    assert plan.num_merge_tokens > 0 and plan.num_finished == 0
    check_merge_layout(plan)


def test_leaf_max_rows() -> None:
    # The most rows of a 16-row item, which picks the leaf kernel's form on the GPU.
    table, lens = tree_batch("1,256_256,32", 16)
    plan = PrefixAttention(32, 8, 128, 16).plan(table, lens)
    assert plan.leaf_max_rows == 4
    assert plan.leaf_tiles == 256 * 2  # 256 leaves of 32 tokens: 2 tiles of 16 each
    assert PrefixAttention(16, 1, 128, 16).plan(table, lens).leaf_max_rows == 16
    # Three tokens of one request at group 4: a 12-row item.
    plan = PrefixAttention(32, 8, 128, 16).plan(table[:1], lens[:1], np.array([0, 3]))
    assert plan.leaf_max_rows == 12
    # No 16-row items at all.
    table, lens = tree_batch("1,10_4096,416", 16)
    plan = PrefixAttention(32, 8, 128, 16).plan(table, lens)
    assert all(m > 16 for m, _ in plan.tiles) and plan.leaf_max_rows == plan.leaf_tiles == 0
