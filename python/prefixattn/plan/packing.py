"""Pack a prefix forest into work items (PAT section 5.1) and lay them out as a plan.

Three packings:

- ``"memory"``: PAT's TreeHeuristic with a memory-centric profit model in bytes. A child
  ``c`` of node ``u`` is *merged* into ``u`` (its work item also reads the KV carried down
  to ``u``) when that saves more partial-result traffic than it costs in repeated KV reads::

      saved: tokens(c) * group * 2 * (head_dim * elem_bytes + 4)
             (o in the cache dtype and fp32 lse, written and read back)
      cost:  carried_len(u) * 2 * head_dim * elem_bytes
             (K and V of the carried pages read again)
      merge when saved > cost

  Otherwise ``c`` gets its own item and its tokens stay in ``u``'s item.
- ``"naive"``: every forest node is its own item (each distinct page read once per query-row
  tile).
- ``"per_query"``: one item per request over its whole KV (the query-centric baseline).

Then, for every packing:

- items with more query rows (tokens x group) than the largest tile are cut into
  row-chunks that each read the item's KV;
- long-KV split (``split_kv``): row chunks longer than the split length (the mean KV length
  of the forest nodes that serve tokens; of the requests for ``"per_query"``; at least
  ``min_split_tokens``, ``PlanOptions.min_split_tokens``) are cut, on page boundaries, into
  equal parts no longer than it.
  Splitting pays only where a long pair would otherwise run on while the rest of its launch
  has finished: with ``split_target`` (the SM count) a chunk is cut only when its KV length
  is more than ``SPLIT_SLACK`` times its launch's share per SM (the KV tokens of all pairs of
  the chunks of its tile height, divided by ``split_target``), into parts no longer than
  1 / ``SPLIT_SLACK`` of that share and no shorter than ``min_split_tokens``; the memory
  packing merges children as without a split.
  ``split_target=0`` cuts every chunk longer than the split length, and the memory packing
  does not merge a child into its parent when the merged item would be cut;
- each item picks its (m, n) tile from the tile table; items are grouped by tile and, inside
  a group, ordered longest first;
- partial rows are given only to tokens covered by more than one item.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..options import DEFAULT_LEAF_SPLIT_TOKENS, DEFAULT_MIN_SPLIT_TOKENS
from .forest import PrefixForest
from .layout import (
    FINISH_MAX_PARTIALS,
    FINISH_RADIX,
    LEAF_TILE_TOKENS,
    Q_OUT_FINISH_BASE,
    pairs_per_sm,
)
from .tiles import TileTable
from .types import PlanArrays

PACKINGS = ("memory", "naive", "per_query")

# A split part is never shorter than this many KV tokens by default (PlanOptions.min_split_tokens).
MIN_SPLIT_TOKENS = DEFAULT_MIN_SPLIT_TOKENS
# ... and of plans whose row chunks all take the leaf kernel (PlanOptions.leaf_split_tokens).
LEAF_SPLIT_TOKENS = DEFAULT_LEAF_SPLIT_TOKENS
# With a split target, a row chunk is cut only where one of its (item, KV head) pairs holds
# more than this many times its launch's KV tokens per SM (unsplit, that launch would leave
# SMs idle for more than half of its time), into parts of at most 1 / SPLIT_SLACK of that.
SPLIT_SLACK = 2
# With split_waves, what a pair costs beside its KV tokens in the makespan estimate of a
# launch: about four 64-key tiles, the time a `wgmma` block takes from a pair's start to its
# first tile (docs/dev/log.md, v62).
WAVE_PAIR_TOKENS = 256
# split_waves looks only at launches of at most this many rounds: beyond, a partly filled last
# round costs at most 1 / WAVE_MAX_ROUNDS of the launch, and the estimates stay few.
WAVE_MAX_ROUNDS = 8
# A merged token the leaf launch finishes has at most this many other partial rows (its q_out
# holds the count in 4 bits; see finish_in_leaf).
MAX_FINISH_OTHERS = FINISH_RADIX - 1
# The leaf launch finishes tokens only where its warps run at most this many pairs each, or
# pairs of at least this many 16-token tiles on average (docs/dev/log.md, v25).
FINISH_MAX_PAIRS_PER_WARP = 2
FINISH_MIN_TILES_PER_PAIR = 8


@dataclasses.dataclass(frozen=True)
class BatchShape:
    """Sizes the packer's cost model and byte accounting need."""

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    elem_bytes: int

    @property
    def group_size(self) -> int:
        return self.num_qo_heads // self.num_kv_heads

    def kv_bytes(self, tokens: int) -> int:
        """Bytes of K and V of ``tokens`` positions (all KV heads)."""
        return tokens * 2 * self.num_kv_heads * self.head_dim * self.elem_bytes

    def partial_bytes(self, rows: int) -> int:
        """o (in the cache dtype) and fp32 lse of ``rows`` partial rows, written once and read
        once."""
        return rows * self.num_qo_heads * (self.head_dim * self.elem_bytes + 4) * 2


class _Items:
    """Work items before layout: a KV page range each, and the requests it serves as runs of
    ``members`` (the forest's DFS order, or plain request ids for ``per_query``)."""

    def __init__(self, members: np.ndarray) -> None:
        self.members = members
        self.page_begin: list[int] = []
        self.token_end: list[int] = []
        self.run_item: list[int] = []
        self.run_begin: list[int] = []
        self.run_end: list[int] = []


def _items_memory(
    forest: PrefixForest, shape: BatchShape, qo_len: np.ndarray, max_rows: int, hold_len: float
) -> _Items:
    """Items of the memory packing; no child is merged into an item longer than ``hold_len``."""
    items = _Items(forest.order)
    ps = forest.page_size
    g = shape.group_size
    partial_per_token = shape.partial_bytes(1)
    kv_per_position = shape.kv_bytes(1)
    # New tokens below each node, from a prefix sum over requests in DFS order.
    csum = np.concatenate(([0], np.cumsum(qo_len[forest.order])))
    below = (csum[forest.req_end] - csum[forest.req_begin]).tolist()
    page_begin = forest.page_begin.tolist()
    token_end = forest.token_end.tolist()
    req_begin = forest.req_begin.tolist()
    req_end = forest.req_end.tolist()
    children = forest.children
    it_begin, it_end = items.page_begin, items.token_end
    run_item, run_begin, run_end = items.run_item, items.run_begin, items.run_end

    def visit(u: int, carried_begin: int) -> None:
        carried = (token_end[u] - carried_begin * ps) * kv_per_position
        rows = below[u] * g  # rows of u's own item while no child is merged
        cursor = req_begin[u]  # u's item serves u's range minus the merged children's
        w = len(it_begin)
        it_begin.append(carried_begin)
        it_end.append(token_end[u])
        for c in children[u]:
            rows_c = below[c] * g
            # Merging c: u's item loses c's rows (fewer row-chunks may read the carried KV),
            # c's item reads the carried KV once per its own row-chunk, and c's tokens skip
            # one partial round trip. An item longer than hold_len would be cut again,
            # undoing the merge.
            saved = (-(-rows // max_rows) - -(-(rows - rows_c) // max_rows)) * carried + below[
                c
            ] * partial_per_token
            if (
                token_end[c] - carried_begin * ps <= hold_len
                and saved > -(-rows_c // max_rows) * carried
            ):
                rows -= rows_c
                run_item.append(w)
                run_begin.append(cursor)
                run_end.append(req_begin[c])
                cursor = req_end[c]
                start = carried_begin
            else:
                start = page_begin[c]
            if children[c]:
                visit(c, start)
            else:  # a leaf: its own item over [start, its end)
                run_item.append(len(it_begin))
                run_begin.append(req_begin[c])
                run_end.append(req_end[c])
                it_begin.append(start)
                it_end.append(token_end[c])
        run_item.append(w)
        run_begin.append(cursor)
        run_end.append(req_end[u])

    for root in forest.roots:
        if children[root]:
            visit(root, page_begin[root])
        else:
            run_item.append(len(it_begin))
            run_begin.append(req_begin[root])
            run_end.append(req_end[root])
            it_begin.append(page_begin[root])
            it_end.append(token_end[root])
    return items


def _items_naive(forest: PrefixForest) -> _Items:
    items = _Items(forest.order)
    items.page_begin = forest.page_begin.tolist()
    items.token_end = forest.token_end.tolist()
    items.run_item = list(range(forest.num_nodes))
    items.run_begin = forest.req_begin.tolist()
    items.run_end = forest.req_end.tolist()
    return items


def _items_per_query(num_pages: np.ndarray, seq_lens: np.ndarray) -> _Items:
    rows = np.flatnonzero(num_pages > 0)
    items = _Items(rows)
    items.page_begin = [0] * len(rows)
    items.token_end = seq_lens[rows].tolist()
    items.run_item = list(range(len(rows)))
    items.run_begin = list(range(len(rows)))
    items.run_end = list(range(1, len(rows) + 1))
    return items


def _segment_rank(seg: np.ndarray, num_segments: int) -> tuple[np.ndarray, np.ndarray]:
    """For sorted segment ids: (rank of each element inside its segment, segment sizes)."""
    sizes = np.bincount(seg, minlength=num_segments)
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    return np.arange(len(seg)) - starts[seg], sizes


def page_runs(
    block_table: np.ndarray, row: np.ndarray, col: np.ndarray, npages: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Store the page ids items read: item ``w`` reads ``npages[w]`` entries of
    ``block_table[row[w]]`` from column ``col[w]``. Overlapping or adjacent column ranges of
    one row form one run; runs are stored in (row, first column) order. Returns each item's
    offset of its first page in the stored ids (0 for an item without pages) and the ids.

    Worked example: items (row 0, cols 0-3), (row 1, cols 2-3), (row 0, cols 2-5): runs
    row 0 cols 0-5 (offset 0) and row 1 cols 2-3 (offset 6); offsets [0, 6, 2].
    """
    offset = np.zeros(len(row), dtype=np.int64)
    has = np.flatnonzero(npages > 0)
    if not len(has):
        return offset, np.zeros(0, dtype=block_table.dtype)
    o = has[np.lexsort((col[has], row[has]))]
    r, c, e = row[o], col[o], col[o] + npages[o]
    # The furthest end so far in the same row (rows ascend and ends are below width + 1).
    reach = np.maximum.accumulate(r * (block_table.shape[1] + 1) + e) - r * (
        block_table.shape[1] + 1
    )
    opens = np.ones(len(o), dtype=bool)
    opens[1:] = (r[1:] != r[:-1]) | (c[1:] > reach[:-1])
    first = np.flatnonzero(opens)
    run = np.cumsum(opens) - 1
    run_row, run_col = r[first], c[first]
    run_len = np.maximum.reduceat(e, first) - run_col
    base = np.concatenate(([0], np.cumsum(run_len)[:-1]))
    offset[o] = base[run] + c - run_col[run]
    total = int(run_len.sum())
    if total >= 2**31:
        raise ValueError("the plan's page ids exceed int32 offsets")
    if total <= 16 * len(first):
        # Few pages per run: one gather is cheaper than a slice per run.
        cols = np.arange(total) + np.repeat(run_col - base, run_len)
        pages = block_table[np.repeat(run_row, run_len), cols]
    else:
        pages = np.concatenate(
            [
                block_table[a, b : b + n]
                for a, b, n in zip(
                    run_row.tolist(), run_col.tolist(), run_len.tolist(), strict=True
                )
            ]
        )
    if pages.max() >= 2**31:
        raise IndexError(f"block_table holds page id {int(pages.max())}, beyond int32 range")
    return offset, pages


def part_bounds(
    lens: np.ndarray, parts: np.ndarray, page_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The split of chunks of ``lens`` KV tokens into ``parts[c]`` page-aligned parts of
    equal page counts (+-1): each part's chunk and its bounds relative to the chunk's start.

    Worked example: lens [100], parts [3], page size 16 (7 pages) -> parts of 2, 2 and 3
    pages: begin [0, 32, 64], end [32, 64, 100].
    """
    owner = np.repeat(np.arange(len(lens)), parts)
    rank, _ = _segment_rank(owner, len(lens))
    pages, p = -(-lens[owner] // page_size), parts[owner]
    begin = (rank * pages // p) * page_size
    end = np.minimum(lens[owner], ((rank + 1) * pages // p) * page_size)
    return owner, begin, end


def launch_makespan(
    lens: np.ndarray, parts: np.ndarray, heads: int, slots: int, page_size: int
) -> int:
    """Estimated makespan, in KV tokens, of one launch whose row chunks have KV lengths
    ``lens`` and are cut into ``parts`` page-aligned parts each, run as the kernels run a
    launch: ``heads`` pairs per part, item-fastest in longest-first order, grid-strided over
    ``ceil(pairs / rounds)`` blocks with ``rounds = ceil(pairs / slots)``. Each pair costs
    its part's tokens plus ``WAVE_PAIR_TOKENS``.

    Worked example: eight row chunks of 4096 tokens at page size 16, 8 KV heads, 132 slots:
    2 parts each -> 128 pairs, one round, 2048 + 256 = 2304; 5 parts each (51 or 52 pages)
    -> 320 pairs in 3 rounds on 107 blocks, 3232 on the busiest block.
    """
    _, begin, end = part_bounds(lens, parts, page_size)
    cost = np.sort(end - begin)[::-1] + WAVE_PAIR_TOKENS
    seq = np.tile(cost, heads)  # pair j = head * items + item: item-fastest
    n = len(seq)
    if n == 0:
        return 0
    rounds = -(-n // slots)
    blocks = -(-n // rounds)
    return int(np.bincount(np.arange(n) % blocks, weights=seq, minlength=blocks).max())


def fill_waves(
    parts: np.ndarray,
    chunk_len: np.ndarray,
    height: np.ndarray,
    slots: np.ndarray,
    heads: int,
    page_size: int,
) -> np.ndarray:
    """The split rule's ``parts`` per row chunk, with fewer parts where that fills the SMs'
    waves better: for each tile height with split chunks whose launch takes ``rounds = ceil(
    pairs / slots)`` of 2 to ``WAVE_MAX_ROUNDS`` rounds, every split chunk's parts are scaled
    by k x slots / pairs (k = 1 .. rounds - 1: k full rounds; at least 1 part, at most the
    rule's) and the choice with the shortest :func:`launch_makespan` is kept (ties: fewer
    parts). ``slots``: pairs the GPU runs at once for each chunk's height.

    Worked example: the 128-row launch of a decode step of 256 requests under one
    4096-token prefix at group size 4 (8 row chunks of 4096 tokens, 8 KV heads, 132 SMs):
    the rule cuts each chunk into 5 parts (320 pairs, 3 rounds); 2 parts run in one round,
    an estimated 2304 tokens against 3232 (:func:`launch_makespan`), so each chunk gets 2.
    """
    out = parts.copy()
    for h in np.unique(height[parts > 1]):
        member = np.flatnonzero(height == h)
        p, lens = parts[member], chunk_len[member]
        s = int(slots[member[0]])
        n = heads * int(p.sum())
        rounds = -(-n // s)
        if rounds > WAVE_MAX_ROUNDS:
            continue
        best, best_cost = p, launch_makespan(lens, p, heads, s, page_size)
        for k in range(1, rounds):
            cand = np.where(p > 1, np.clip(p * k * s // n, 1, p), p)
            cost = launch_makespan(lens, cand, heads, s, page_size)
            if cost < best_cost or (cost == best_cost and cand.sum() < best.sum()):
                best, best_cost = cand, cost
        out[member] = best
    return out


def pack(
    forest: PrefixForest,
    block_table: np.ndarray,
    seq_lens: np.ndarray,
    qo_indptr: np.ndarray,
    shape: BatchShape,
    table: TileTable,
    packing: str,
    split_kv: bool,
    split_target: int = 0,
    split_waves: bool = False,
    min_split_tokens: int = MIN_SPLIT_TOKENS,
    leaf_split_tokens: int = LEAF_SPLIT_TOKENS,
) -> tuple[PlanArrays, tuple[tuple[int, int], ...], tuple[int, ...], dict[str, int]]:
    """Pack the batch; returns host arrays, tiles, tile-group bounds and byte accounting.

    ``split_target``: (item, KV head) pairs the GPU runs at once (its SM count): a long row
    chunk is split only where its pairs would leave SMs of their launch idle; 0 splits every
    long item regardless. ``split_waves`` (with a split target): then cut the split chunks
    of each launch into fewer parts where that shortens the launch's estimated makespan
    (:func:`fill_waves`). ``min_split_tokens``: no split part is shorter (the split floor);
    ``leaf_split_tokens``: the floor instead where, with a split target, every row chunk
    takes the leaf kernel (one warp per pair: small decode batches).
    """
    ps = forest.page_size
    qo_indptr = qo_indptr.astype(np.int64)
    qo_len = np.diff(qo_indptr)
    lens = seq_lens.astype(np.int64)
    num_pages = (lens + ps - 1) // ps
    # Long-KV split length: the mean KV length of the forest's nodes that serve tokens (the
    # items before any merge), or of the requests for per_query; never below the split floor.
    split_len = float("inf")
    if split_kv:
        if packing == "per_query":
            lengths = lens[qo_len > 0]
        else:
            csum = np.concatenate(([0], np.cumsum(qo_len[forest.order])))
            below = csum[forest.req_end] - csum[forest.req_begin]
            lengths = (forest.token_end - forest.page_begin.astype(np.int64) * ps)[below > 0]
        if len(lengths):
            split_len = max(float(lengths.mean()), min_split_tokens)
    # Merges are held back from items that would be cut only when every long item is cut.
    hold_len = split_len if split_target == 0 else float("inf")
    if packing == "memory":
        items = _items_memory(forest, shape, qo_len, table.max_rows, hold_len)
    elif packing == "naive":
        items = _items_naive(forest)
    elif packing == "per_query":
        items = _items_per_query(num_pages, lens)
    else:
        raise ValueError(f"unknown packing {packing!r}; expected one of {', '.join(PACKINGS)}")

    g = shape.group_size
    max_tokens = max(1, table.max_rows // g)
    num_tokens = int(qo_indptr[-1])

    # 1. Query slots: every new token of every request of every item, with its causal bound.
    n_items = len(items.page_begin)
    it_begin = np.asarray(items.page_begin, dtype=np.int64) * ps  # first position
    it_tok_end = np.asarray(items.token_end, dtype=np.int64)
    run_item = np.asarray(items.run_item, dtype=np.int64)
    run_begin = np.asarray(items.run_begin, dtype=np.int64)
    run_len = np.asarray(items.run_end, dtype=np.int64) - run_begin
    by_item = np.argsort(run_item, kind="stable")
    run_item, run_begin, run_len = run_item[by_item], run_begin[by_item], run_len[by_item]
    pair_item = np.repeat(run_item, run_len)
    offsets = np.cumsum(run_len) - run_len
    pos = np.arange(len(pair_item)) - np.repeat(offsets - run_begin, run_len)
    reqs = items.members[pos].astype(np.int64)
    n = qo_len[reqs]
    slot_pair = np.repeat(np.arange(len(reqs)), n)
    within = np.arange(len(slot_pair)) - np.repeat(np.cumsum(n) - n, n)
    slot_req = reqs[slot_pair]
    slot_item = pair_item[slot_pair]
    slot_tok = qo_indptr[slot_req] + within
    slot_lim = lens[slot_req] - qo_len[slot_req] + within + 1
    # A slot whose bound excludes the whole item would only produce an empty partial.
    keep = slot_lim > it_begin[slot_item]
    slot_item, slot_tok, slot_lim, slot_req = (
        slot_item[keep],
        slot_tok[keep],
        slot_lim[keep],
        slot_req[keep],
    )

    # 2. Row chunks: at most ``max_tokens`` tokens per item (the largest query tile).
    rank, _ = _segment_rank(slot_item, n_items)
    opens = rank % max_tokens == 0  # slots are sorted by item: a chunk opens every max_tokens
    chunk_first = np.flatnonzero(opens)
    slot_chunk = np.cumsum(opens) - 1
    chunk_item = slot_item[chunk_first]
    n_chunks = len(chunk_first)
    chunk_req = slot_req[chunk_first] if n_chunks else np.zeros(0, dtype=np.int64)
    chunk_begin = it_begin[chunk_item]
    chunk_end = np.minimum(
        it_tok_end[chunk_item],
        np.maximum.reduceat(slot_lim, chunk_first) if n_chunks else np.zeros(0, dtype=np.int64),
    )

    # 3. Long-KV split into equal page-aligned parts no longer than the split length. With a
    #    split target, only chunks whose pairs would leave the SMs idle are cut: those whose KV
    #    is more than SPLIT_SLACK times their launch's share per SM (the KV tokens of all pairs
    #    of the chunks of the same tile height, over split_target), into parts no longer than
    #    1 / SPLIT_SLACK of that share and no shorter than the split floor (leaf_split_tokens
    #    where every chunk takes the leaf kernel, else min_split_tokens).
    chunk_len = chunk_end - chunk_begin
    chunk_pages = -(-chunk_len // ps)
    parts = np.ones(n_chunks, dtype=np.int64)
    if split_kv and n_chunks:
        parts = np.maximum(
            np.minimum(np.ceil(chunk_len / split_len).astype(np.int64), chunk_pages), 1
        )
        if split_target > 0:
            chunk_rows = np.diff(np.append(chunk_first, len(slot_item))) * g
            m_sizes = np.asarray(table.m_sizes)
            height = table.height_index(chunk_rows, chunk_len)
            launch_len = np.zeros(len(m_sizes), dtype=np.int64)
            np.add.at(launch_len, height, chunk_len)
            launch_share = shape.num_kv_heads * launch_len[height]  # x slots
            per_sm = np.asarray([pairs_per_sm(int(m), shape.head_dim) for m in m_sizes])
            # From SPLIT_SLACK * share + 1 slots on, every chunk is idle and its balanced
            # parts exceed its floor, so a larger target decides the same: capping it there
            # keeps the products exact (a target of 2**63 - 1 would wrap int64).
            target = min(split_target, SPLIT_SLACK * int(launch_share.max()) + 1)
            slots = target * per_sm[height]
            big = int(chunk_len.max()) * int(slots.max()) * SPLIT_SLACK >= 2**63
            if big:  # exact Python ints where int64 could wrap
                slots, chunk_len = slots.astype(object), chunk_len.astype(object)
            idle = chunk_len * slots > SPLIT_SLACK * launch_share
            balanced = -(-(SPLIT_SLACK * slots * chunk_len) // np.maximum(launch_share, 1))
            leaf_only = bool(np.all(per_sm[height] > 1))
            floor = leaf_split_tokens if leaf_only else min_split_tokens
            floor_parts = np.maximum(chunk_len // floor, 1)
            # Leaf chunks (one warp per pair) are cut by the balance alone, not by the split
            # length: one long request would otherwise keep a single part.
            cap = np.where(per_sm[height] > 1, chunk_pages, parts)
            parts = np.where(idle, np.minimum(np.minimum(cap, balanced), floor_parts), 1)
            if big:
                parts, chunk_len = parts.astype(np.int64), chunk_len.astype(np.int64)
            elif split_waves:
                parts = fill_waves(parts, chunk_len, height, slots, shape.num_kv_heads, ps)
    part_chunk, rel_begin, rel_end = part_bounds(chunk_len, parts, ps)
    part_begin = chunk_begin[part_chunk] + rel_begin
    part_end = chunk_begin[part_chunk] + rel_end
    # Slots of each part: the chunk's slots whose bound reaches into the part.
    part_first = np.concatenate(([0], np.cumsum(parts)[:-1]))
    rep = parts[slot_chunk]
    s_idx = np.repeat(np.arange(len(slot_chunk)), rep)
    s_rank = np.arange(len(s_idx)) - np.repeat(np.cumsum(rep) - rep, rep)
    s_part = part_first[slot_chunk[s_idx]] + s_rank
    order_ = np.lexsort((s_idx, s_part))
    s_idx, s_part = s_idx[order_], s_part[order_]
    vis = slot_lim[s_idx] > part_begin[s_part]
    s_idx, s_part = s_idx[vis], s_part[vis]
    n_parts = len(part_begin)
    part_slots = np.bincount(s_part, minlength=n_parts)
    live = part_slots > 0
    # Trim each part to the furthest bound among its slots.
    if len(s_part):
        starts = np.searchsorted(s_part, np.flatnonzero(live))
        part_end[live] = np.minimum(part_end[live], np.maximum.reduceat(slot_lim[s_idx], starts))

    # 4. Tiles and order: group by tile, longest KV first inside a group.
    part_len = part_end - part_begin
    m_sizes = np.asarray(table.m_sizes)
    n_bounds = np.asarray([b for b, _ in table.n_by_kv_len])
    n_sizes = np.asarray([n for _, n in table.n_by_kv_len])
    mi = table.height_index(part_slots * g, part_len)
    ni = np.minimum(np.searchsorted(n_bounds, part_len), len(n_sizes) - 1)
    key = m_sizes[mi] * 65536 + n_sizes[ni]
    alive = np.flatnonzero(live)
    used, tid_alive = np.unique(key[alive], return_inverse=True)
    tiles = tuple((int(k) // 65536, int(k) % 65536) for k in used)
    perm = alive[np.lexsort((-part_len[alive], tid_alive))]
    tid = np.sort(tid_alive)
    num_items = len(perm)
    new_id = np.full(n_parts, -1, dtype=np.int64)
    new_id[perm] = np.arange(num_items)
    tile_indptr = tuple(np.searchsorted(tid, np.arange(len(tiles) + 1)).tolist())

    # 5. Pages of each item: a run of its representative request's block-table row. Items
    #    that read overlapping or adjacent columns of one row share one stored run, so the
    #    page ids stored are at most the block table's used entries (a chunked prefill's row
    #    chunks all read the same context: stored once, not once per chunk).
    w_begin = part_begin[perm]
    w_len = part_len[perm]
    w_row = chunk_req[part_chunk[perm]]
    page_offset, pages = page_runs(block_table, w_row, w_begin // ps, -(-w_len // ps))

    # 6. Query slots in item order.
    w_of_slot = new_id[s_part]
    sorder = np.lexsort((s_idx, w_of_slot))
    q_item = w_of_slot[sorder]
    q_src = s_idx[sorder]
    q_tokens = slot_tok[q_src]
    q_limit = slot_lim[q_src]
    q_indptr = np.searchsorted(q_item, np.arange(num_items + 1))

    # 7. Partials only for tokens covered by several slots, grouped by token for the merge.
    cover = np.bincount(q_tokens, minlength=num_tokens)
    multi = np.flatnonzero(cover[q_tokens] > 1)
    by_token = multi[np.argsort(q_tokens[multi], kind="stable")]
    q_out = np.full(len(q_tokens), -1, dtype=np.int64)
    q_out[by_token] = np.arange(len(by_token))
    merge_tokens = np.flatnonzero(cover > 1)
    merge_indptr = np.concatenate(([0], np.cumsum(cover[merge_tokens])))

    i32 = np.int32
    host = PlanArrays(
        kv_page_offset=page_offset.astype(i32),
        kv_pages=pages.astype(i32),
        kv_start=w_begin.astype(i32),
        kv_len=w_len.astype(i32),
        q_indptr=q_indptr.astype(i32),
        q_tokens=q_tokens.astype(i32),
        q_limit=q_limit.astype(i32),
        q_out=q_out.astype(i32),
        tile_id=tid.astype(i32),
        tile_indptr=np.asarray(tile_indptr, dtype=i32),
        merge_tokens=merge_tokens.astype(i32),
        merge_indptr=merge_indptr.astype(i32),
        merge_partials=np.arange(len(by_token), dtype=i32),
    )
    accounting = {
        "kv_bytes": shape.kv_bytes(int(w_len.sum())),
        "partial_bytes": shape.partial_bytes(len(by_token)),
        "num_partials": len(by_token),
    }
    return host, tiles, tile_indptr, accounting


def finish_in_leaf(
    host: PlanArrays,
    leaf_items: np.ndarray,
    num_tokens: int,
    num_kv_heads: int,
    leaf_warps: int,
) -> tuple[PlanArrays, int]:
    """Let the leaf launch finish the merged tokens it can; returns the arrays and their count.

    ``leaf_items``: bool [W], the items the leaf kernel runs (16-row tiles at head_dim <= 128);
    ``leaf_warps``: the warps its launch runs at once (SMs x ``LEAF_PAIRS_PER_SM``).
    Finishing puts a round trip per other partial row on each leaf pair's path, and makes the
    leaf launch wait for the others, so it is used only where a warp runs few pairs (at most
    ``FINISH_MAX_PAIRS_PER_WARP``) or long ones (at least ``FINISH_MIN_TILES_PER_PAIR``
    16-token tiles on average); otherwise the plan is returned unchanged.
    A merged token with exactly one slot in a leaf item is *finished* by that item: the leaf
    launch runs after every other forward launch of the call, reads the token's other partial
    rows and writes its output, so the merge launch skips it. In the returned arrays:

    - finished tokens come last in ``merge_tokens`` (the merge launch takes the first
      ``len(merge_tokens) - count``), the order of the others unchanged;
    - a finished token's own partial row (the one its leaf slot writes when the leaf launch
      does not finish: concurrent tile groups, the 16-row tile instead of the leaf kernel;
      then the merge takes every token) is the last of its rows in ``merge_partials``, at
      position ``j``, its ``n`` other rows (1-15) just before it; its leaf slot has
      ``q_out = -2 - (16 * j + n)``, so the leaf kernel finds the other rows without reading
      ``merge_indptr``. Tokens with more than 15 other rows stay with the merge launch.

    Worked example: token 5 has partial rows 3 (root item) and 4 (leaf item), token 6 rows 5
    and 6, both in leaf items: token 5 is finished, ``merge_tokens`` [6, 5], ``merge_indptr``
    [0, 2, 4], ``merge_partials`` [5, 6, 3, 4], and the leaf slot of token 5 has q_out
    -2 - (16 * 3 + 1) = -51.
    """
    m_count = len(host.merge_tokens)
    # 16 * j + n must fit in int32.
    if m_count == 0 or not leaf_items.any() or len(host.merge_partials) >= FINISH_MAX_PARTIALS:
        return host, 0
    pairs = int(leaf_items.sum()) * num_kv_heads
    leaf_len = host.kv_len[leaf_items].astype(np.int64)
    tiles = int((-(-leaf_len // LEAF_TILE_TOKENS)).sum()) * num_kv_heads
    if pairs > FINISH_MAX_PAIRS_PER_WARP * leaf_warps and tiles < FINISH_MIN_TILES_PER_PAIR * pairs:
        return host, 0
    q_out = host.q_out.astype(np.int64)
    item_of_slot = np.repeat(np.arange(len(host.kv_len)), np.diff(host.q_indptr))
    tok2m = np.full(num_tokens, -1, dtype=np.int64)
    tok2m[host.merge_tokens] = np.arange(m_count)
    leaf_part = np.flatnonzero(leaf_items[item_of_slot] & (q_out >= 0))
    leaf_m = tok2m[host.q_tokens[leaf_part]]
    per_token = np.bincount(leaf_m, minlength=m_count)
    sizes: np.ndarray = np.diff(host.merge_indptr).astype(np.int64)
    finished = (per_token == 1) & (sizes <= MAX_FINISH_OTHERS + 1)
    count = int(finished.sum())
    if count == 0:
        return host, 0
    # New merge order: open tokens first, then finished ones (each keeps its relative order).
    perm = np.concatenate((np.flatnonzero(~finished), np.flatnonzero(finished)))
    rank = np.empty(m_count, dtype=np.int64)
    rank[perm] = np.arange(m_count)
    seg = np.repeat(np.arange(m_count), sizes)
    # The leaf slot's row of a finished token goes last among the token's rows.
    fin = finished[leaf_m]
    fin_slots, fin_m = leaf_part[fin], leaf_m[fin]
    own_row = np.full(m_count, -1, dtype=np.int64)
    own_row[fin_m] = q_out[fin_slots]
    rows = host.merge_partials.astype(np.int64)
    order = np.lexsort((rows == own_row[seg], rank[seg]))
    indptr = np.concatenate(([0], np.cumsum(sizes[perm])))
    own_pos = indptr[rank[fin_m] + 1] - 1
    q_out[fin_slots] = Q_OUT_FINISH_BASE - (FINISH_RADIX * own_pos + sizes[fin_m] - 1)
    i32 = np.int32
    new = dataclasses.replace(
        host,
        q_out=q_out.astype(i32),
        merge_tokens=host.merge_tokens[perm].astype(i32),
        merge_indptr=indptr.astype(i32),
        merge_partials=rows[order].astype(i32),
    )
    return new, count
