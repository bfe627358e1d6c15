"""The planning policy: checked host inputs -> a host plan (numpy; no device work).

:func:`build_host_plan` builds the forest and packs it (with the compiled planner or the
Python reference, identical output), then re-plans where another tile table does better:

- the narrow table (``TileTable.narrow``: no 128-row tiles) where it moves at most
  ``narrow_traffic`` times the KV and partial-row bytes;
- one tile height for every item where all (item, KV head) pairs fit in one wave, so the
  forward is one launch (``one_launch_in_one_wave``);

and fills the ``counts`` array of the plan/kernel contract (:mod:`prefixattn.plan.layout`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from .forest import PrefixForest, build_forest
from .layout import (
    LEAF_PAIRS_PER_SM,
    LEAF_TILE_TOKENS,
    VARIANT_ROWS,
    leaf_kernel_runs,
    packed_heads,
    variant_bounds,
)
from .native import build_plan_native
from .packing import LEAF_SPLIT_TOKENS, MIN_SPLIT_TOKENS, BatchShape, pack
from .packing import finish_in_leaf as finish_tokens_in_leaf
from .tiles import TileTable
from .types import PlanArrays

DEVICE_ARRAYS = (
    "kv_page_offset", "kv_pages", "kv_start", "kv_len", "q_indptr", "q_tokens", "q_limit",
    "q_out", "tile_id", "merge_tokens", "merge_indptr", "merge_partials",
)  # fmt: skip
"""The plan arrays that go to the device (besides ``counts``), in load order."""


@dataclasses.dataclass(frozen=True)
class HostPlan:
    """A plan of one batch on the host: the arrays to load and the values of the
    :class:`~prefixattn.plan.types.LaunchPlan` fields that do not live on the device."""

    host: PlanArrays
    forest: PrefixForest
    tiles: tuple[tuple[int, int], ...]
    tile_indptr: tuple[int, ...]
    counts: np.ndarray
    """int32 [COUNTS_LEN] (:mod:`prefixattn.plan.layout`)."""
    num_tokens: int
    num_partials: int
    num_finished: int
    max_page_id: int
    kv_bytes: int
    partial_bytes: int
    distinct_kv_bytes: int
    query_centric_kv_bytes: int
    qo_bytes: int
    leaf_max_rows: int
    leaf_tiles: int
    narrow: bool
    lineage: object = dataclasses.field(default_factory=object, compare=False, repr=False)
    """The same object for a plan and the plans advanced from it (:mod:`.advance`), whose
    shared work items are the same: what depends on those alone may be kept across them."""

    def device_arrays(self) -> dict[str, np.ndarray]:
        """The int32 arrays the device stage loads, ``counts`` last."""
        return {n: getattr(self.host, n) for n in DEVICE_ARRAYS} | {"counts": self.counts}


PLAN_BYTES_PER_PAGE = 8
PLAN_BYTES_PER_SLOT = 64
PLAN_BYTES_PER_ITEM = 512
"""Host bytes per page id, (item, token) slot and work item or forest node that a plan
takes while it is built (its arrays and the planner's temporaries; measured on the Python
planner, which takes about twice the compiled one's)."""


@dataclasses.dataclass(frozen=True)
class PlanEstimate:
    """The size of the plans one ``plan*`` call builds, estimated from the lengths alone."""

    work_items: int
    slots: int
    pages: int
    nbytes: int

    def describe(self) -> str:
        return (
            f"about {self.nbytes / 2**30:.2f} GiB ({self.work_items} work items, "
            f"{self.slots} query slots, {self.pages} page ids)"
        )


def estimate_plan(
    lens: np.ndarray, indptr: np.ndarray, page_size: int, group_size: int, tiles: TileTable
) -> PlanEstimate:
    """The plans' size from the lengths (O(batch), before any planning).

    Each request's new tokens go in row chunks of at most ``max_rows // group_size`` tokens
    (the per-request plan; sharing makes prefix-aware plans smaller). The chunks of one
    request read runs of the same block-table row, which the plan stores once, so the page ids
    are at most the requests' pages. The plans the planner may build for one call count
    together (the narrow table's, of smaller chunks, is built beside the first).
    """
    n = np.diff(indptr).astype(np.float64)
    live = n > 0
    n, length = n[live], lens[live].astype(np.float64)
    batch = int(live.sum())
    items = slots = pages = 0.0
    narrow = tiles.narrow()
    tables = [tiles] if narrow is None else [tiles, narrow]
    for t in tables:
        per_chunk = max(1, t.max_rows // group_size)
        c = np.ceil(n / per_chunk)
        pages += float(np.ceil(length / page_size).sum())
        items += float(c.sum())
        slots += float(n.sum())
    nodes = 2 * batch * len(tables)  # forest nodes and their items
    nbytes = (
        PLAN_BYTES_PER_PAGE * pages
        + PLAN_BYTES_PER_SLOT * slots
        + PLAN_BYTES_PER_ITEM * (items + nodes)
    )
    return PlanEstimate(int(items), int(slots), int(pages), int(nbytes))


def check_plan_size(
    lens: np.ndarray,
    indptr: np.ndarray,
    page_size: int,
    group_size: int,
    tiles: TileTable,
    max_bytes: int | None,
) -> None:
    """Raise ``MemoryError`` where :func:`estimate_plan` exceeds ``max_bytes`` (None: no
    limit)."""
    if max_bytes is None:
        return
    est = estimate_plan(lens, indptr, page_size, group_size, tiles)
    if est.nbytes > max_bytes:
        raise MemoryError(
            f"prefixattn: planning this batch would take {est.describe()} of host memory, "
            f"more than PlanOptions.max_plan_bytes = {max_bytes} ({max_bytes / 2**30:.2f} "
            f"GiB): use a larger page_size or shorter prefill chunks, or raise "
            f"max_plan_bytes (None: no limit)"
        )


def entries_read(
    table: np.ndarray, lens: np.ndarray, indptr: np.ndarray, page_size: int
) -> np.ndarray:
    """bool [B, cols]: the block-table entries a plan reads, the first
    ``ceil(len / page_size)`` of each request with new tokens (padding rows are not read)."""
    used = np.where(np.diff(indptr) > 0, (lens + page_size - 1) // page_size, 0)
    return np.arange(table.shape[1])[None, :] < used[:, None]


def _check_pages(
    pages: np.ndarray, table: np.ndarray, lens: np.ndarray, indptr: np.ndarray, page_size: int
) -> None:
    """Page ids the plan reads must be valid (only used entries are read; junk is ignored)."""
    if pages.size and pages.min() < 0:
        read = entries_read(table, lens, indptr, page_size)
        b, j = (int(x) for x in np.argwhere(read & (table < 0))[0])
        raise IndexError(f"block_table[{b}, {j}] = {int(table[b, j])} is a negative page id")


def build_host_plan(
    table: np.ndarray,
    lens: np.ndarray,
    indptr: np.ndarray,
    page_size: int,
    shape: BatchShape,
    tiles: TileTable,
    packing: str,
    split_kv: bool,
    *,
    split_target: int,
    sm_count: int,
    native: bool,
    finish_in_leaf: bool,
    one_launch_in_one_wave: bool,
    pack_heads: bool,
    max_bytes: int | None = None,
    page_ids: bool = True,
    split_waves: bool = False,
    min_split_tokens: int = MIN_SPLIT_TOKENS,
    leaf_split_tokens: int = LEAF_SPLIT_TOKENS,
) -> HostPlan:
    """The host plan of checked inputs.

    table: int32 [B, W] page ids (or positions standing for them); lens: int64 [B];
    indptr: int64 [B+1]. ``split_target``: (item, KV head) pairs the GPU runs at once (0:
    split every long item); ``sm_count``: the device's SMs (the leaf launch's warps and the
    pairs that head packing keeps). ``native``: use the compiled planner (its op must be
    registered). ``max_bytes``: refuse (``MemoryError``) where :func:`estimate_plan`
    exceeds it (None: no limit). ``page_ids``: ``table`` holds page ids (the pages read are
    checked, the largest is reported); False: positions in a device table, valid by
    construction (``max_page_id`` -1). The other switches are those of
    :class:`prefixattn.PlanOptions`.
    """
    check_plan_size(lens, indptr, page_size, shape.group_size, tiles, max_bytes)
    num_kv_heads, head_dim = shape.num_kv_heads, shape.head_dim
    target = split_target

    # The forest is built once per call: the Python planner keeps it here, the compiled one
    # in the op's per-thread state (reuse_forest for every build after the first).
    forests: list[Any] = []
    # The leaf launch finishes the merged tokens it can (packing.finish_in_leaf): in the
    # compiled op's call when it plans, else on the Python plan below.
    finish = finish_in_leaf and leaf_kernel_runs(head_dim)
    leaf_warps = sm_count * LEAF_PAIRS_PER_SM if finish else 0

    def build(table_of_tiles: TileTable) -> tuple[Any, Any, Any, Any, Any]:
        if native:
            built = build_plan_native(
                table, lens, indptr, page_size, shape, table_of_tiles, packing, split_kv,
                target, reuse_forest=bool(forests), finish_leaf_warps=leaf_warps,
                split_waves=split_waves, min_split_tokens=min_split_tokens,
                leaf_split_tokens=leaf_split_tokens,
            )  # fmt: skip
            forests.append(built[0])
            return built
        if not forests:
            # Requests without new tokens (padding) take no part in the forest.
            live = np.where(np.diff(indptr) > 0, lens, 0)
            forests.append(build_forest(table, live, page_size))
        forest = forests[0]
        return forest, *pack(
            forest, table, lens, indptr, shape, table_of_tiles, packing, split_kv, target,
            split_waves=split_waves, min_split_tokens=min_split_tokens,
            leaf_split_tokens=leaf_split_tokens,
        )  # fmt: skip

    forest, host, plan_tiles, tile_indptr, acc = build(tiles)
    used = tiles
    narrow = tiles.narrow()
    if narrow is not None and max((m for m, _ in plan_tiles), default=0) > tiles.m_sizes[0]:
        # The narrow plan (no 128-row tiles) where it moves at most narrow_traffic times
        # the KV and partial-row bytes. A plan of smallest tiles alone (every item of at
        # most 16 rows: no sharing, small groups) is the same with either table.
        alt = build(narrow)
        moved = acc["kv_bytes"] + acc["partial_bytes"]
        if alt[4]["kv_bytes"] + alt[4]["partial_bytes"] <= tiles.narrow_traffic * moved:
            forest, host, plan_tiles, tile_indptr, acc = alt
            used = narrow
    took_narrow = used is narrow
    heights = sorted({m for m, _ in plan_tiles})
    pairs = len(host.kv_len) * num_kv_heads
    if one_launch_in_one_wave and len(heights) > 1 and pairs <= target:
        # The whole plan fits in one wave: one tile height (the largest in use) for every
        # item makes the forward one launch instead of one per height. Every item already
        # fits that height, so the items and chunks stay as they are; the split rule then
        # sees one launch, so it can only cut fewer parts (the plan stays in one wave).
        # The packer also sizes row chunks, merges and splits by the table's largest
        # height: keep it, so every item (all fit ``top``) just selects ``top``. The table
        # has no wide rule (``TileTable.wide_kv_len``): that rule already chose ``top``.
        top, largest = heights[-1], used.max_rows
        one = TileTable(
            m_sizes=(top,) if top == largest else (top, largest),
            n_by_kv_len=used.n_by_kv_len,
        )
        forest, host, plan_tiles, tile_indptr, acc = build(one)
    bounds = variant_bounds(plan_tiles, tile_indptr)
    leaf_rows = np.diff(host.q_indptr)[bounds[0] : bounds[1]]
    leaf_max_rows = int(leaf_rows.max(initial=0)) * shape.group_size
    leaf_len = host.kv_len[bounds[0] : bounds[1]].astype(np.int64)
    leaf_tiles = int((-(-leaf_len // LEAF_TILE_TOKENS)).sum())
    num_finished = int(acc.get("num_finished", 0))
    if finish and "num_finished" not in acc:
        # Merged tokens with one slot in the leaf kernel's items (the 16-row variant): that
        # item finishes them (the leaf launch runs last and merges their other rows itself).
        leaf = np.zeros(len(host.kv_len), dtype=bool)
        leaf[bounds[0] : bounds[1]] = True
        host, num_finished = finish_tokens_in_leaf(
            host, leaf, int(indptr[-1]), num_kv_heads, leaf_warps
        )
    if page_ids and not native:  # the compiled planner checks the pages it reads itself
        _check_pages(host.kv_pages, table, lens, indptr, page_size)
    num_tokens = int(indptr[-1])
    distinct_tokens = int((forest.token_end - forest.page_begin.astype(np.int64) * page_size).sum())
    heads = 1
    if pack_heads and bounds[1] > bounds[0]:
        # As many KV heads per pair as the 16-row items' rows allow, while the launch
        # keeps at least one pair per SM.
        sms = target if target > 0 else sm_count
        heads = packed_heads(leaf_max_rows, num_kv_heads, bounds[1] - bounds[0], sms)
        assert leaf_max_rows * heads <= VARIANT_ROWS[0] and num_kv_heads % heads == 0
    counts = np.asarray(
        [len(host.kv_len), len(host.q_tokens), len(host.kv_pages), len(host.merge_tokens),
         acc["num_partials"], num_tokens, *bounds, heads,
         len(host.merge_tokens) - num_finished],
        dtype=np.int32,
    )  # fmt: skip
    return HostPlan(
        host=host,
        forest=forest,
        tiles=plan_tiles,
        tile_indptr=tile_indptr,
        counts=counts,
        num_tokens=num_tokens,
        num_partials=acc["num_partials"],
        num_finished=num_finished,
        max_page_id=int(host.kv_pages.max(initial=-1)) if page_ids else -1,
        kv_bytes=acc["kv_bytes"],
        partial_bytes=acc["partial_bytes"],
        distinct_kv_bytes=shape.kv_bytes(distinct_tokens),
        query_centric_kv_bytes=shape.kv_bytes(int(lens[np.diff(indptr) > 0].sum())),
        qo_bytes=2 * num_tokens * shape.num_qo_heads * head_dim * shape.elem_bytes,
        leaf_max_rows=leaf_max_rows,
        leaf_tiles=leaf_tiles,
        narrow=took_narrow,
    )
