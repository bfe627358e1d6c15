"""The plan/kernel contract on the Python side: the ``counts`` array and the kernel variants.

The CUDA launcher reads a plan's sizes from its device ``counts`` array (kernels launched with
a fixed grid, under CUDA graphs, cannot take them from the host) and runs one kernel variant
per query-tile height. The C++ side defines the same values (``kCount*``, ``kVariantBase``,
``kNumVariants``, ``kVariantRows``; tests/plan/test_layout_contract.py compares them).

Layout of ``counts`` (``COUNTS_LEN`` int32 entries)::

    [0, 6)     COUNTS: num_work_items, num_slots, num_pages, num_merge_tokens,
               num_partials, num_tokens
    [6, 11)    VARIANT_BASE + v .. VARIANT_BASE + v + 1: items of variant v (see below)
    11         PACKED_HEADS: KV heads one pair of the 16-row variant covers
    12         MERGE_OPEN: merged tokens the merge launch takes

It also fixes the encoding of ``q_out`` (``Q_OUT_*``, ``FINISH_*``).
"""

from __future__ import annotations

COUNTS = ("num_work_items", "num_slots", "num_pages", "num_merge_tokens", "num_partials",
          "num_tokens")  # fmt: skip
"""Order of the first entries of the plan's ``counts`` device array."""

COUNT_ITEMS = COUNTS.index("num_work_items")
COUNT_MERGE_TOKENS = COUNTS.index("num_merge_tokens")

VARIANT_ROWS = (16, 32, 64, 128)
"""Query-tile heights of the CUDA kernel variants (ascending). ``counts[VARIANT_BASE + v]`` ..
``counts[VARIANT_BASE + v + 1]`` are the work items that run with variant ``v`` (items are
ordered by tile height), so kernels launched with a fixed grid read them."""

VARIANT_BASE = len(COUNTS)
"""Index in ``counts`` of the first variant bound (always 0: the first item)."""

NUM_VARIANTS = len(VARIANT_ROWS)

PACKED_HEADS = VARIANT_BASE + NUM_VARIANTS + 1
"""Index in ``counts`` of the KV heads one (item, KV heads) pair of the 16-row kernel covers
(see :func:`packed_heads`)."""

MERGE_OPEN = PACKED_HEADS + 1
"""Index in ``counts`` of the merged tokens the merge launch takes when the leaf launch
finishes the others (``num_merge_tokens - LaunchPlan.num_finished``)."""

COUNTS_LEN = MERGE_OPEN + 1
"""Entries of the ``counts`` array (the sizes, the variant bounds, the packed heads, the
merge launch's tokens)."""

Q_OUT_OUTPUT = -1
"""``q_out`` of a query slot that is its token's only one: the item writes the output."""

Q_OUT_FINISH_BASE = -2
FINISH_RADIX = 16
"""``q_out`` of a leaf slot that finishes its merged token:
``Q_OUT_FINISH_BASE - (FINISH_RADIX * j + n)``, where ``merge_partials[j]`` is the slot's own
partial row and ``merge_partials[j - n : j]`` the token's ``n`` other rows
(``n < FINISH_RADIX``). Worked example: j = 5, n = 2 -> -2 - 82 = -84."""

FINISH_MAX_PARTIALS = 2**27
"""Plans with at least this many partial rows finish no token in the leaf launch (the
encoding above stays in int32)."""

LEAF_VARIANT = 0
"""The variant the leaf kernel runs (the 16-row tiles) where the head dim allows it."""

LEAF_MAX_HEAD_DIM = 128
"""The leaf kernel's largest head dim; above it the 16-row variant runs the general tile."""

LEAF_TILE_TOKENS = 16
"""KV tokens of one leaf-kernel tile (kLeafTokens in the leaf kernel)."""

LEAF_PAIRS_PER_SM = 8
"""(item, KV head) pairs the leaf kernel runs at once per SM: 2 blocks of 4 warps, one pair
per warp. The split rule counts the SMs that many times for chunks of the leaf height, so a
launch of few long leaf pairs is cut until every warp has one."""


def variant_of(m: int) -> int:
    """The kernel variant (index into ``VARIANT_ROWS``) that runs query tiles of ``m`` rows.

    Every choice of a kernel for a tile height goes through here: the variant bounds of
    ``counts``, the leaf kernel's items, the variants a hinted plan's fallback may launch.
    """
    if m not in VARIANT_ROWS:
        raise ValueError(f"tile height {m} has no kernel variant ({VARIANT_ROWS})")
    return VARIANT_ROWS.index(m)


def is_leaf_height(m: int) -> bool:
    """Tiles of ``m`` rows run on the 16-row variant (the leaf kernel's, at small head dims)."""
    return m in VARIANT_ROWS and variant_of(m) == LEAF_VARIANT


def leaf_kernel_runs(head_dim: int) -> bool:
    """The 16-row variant runs on the leaf kernel at ``head_dim``."""
    return head_dim <= LEAF_MAX_HEAD_DIM


def pairs_per_sm(m: int, head_dim: int) -> int:
    """Pairs per SM that the split rule assumes for tile height ``m`` at ``head_dim``."""
    return LEAF_PAIRS_PER_SM if is_leaf_height(m) and leaf_kernel_runs(head_dim) else 1


def variant_bounds(tiles: tuple[tuple[int, int], ...], tile_indptr: tuple[int, ...]) -> list[int]:
    """Item bounds per kernel variant from the plan's tile groups (ordered by height).

    Worked example: tiles ((16, 64), (16, 128), (128, 128)), tile_indptr (0, 3, 5, 6) ->
    [0, 5, 5, 5, 6]: items 0-4 run with 16 rows, item 5 with 128.
    """
    variants = [variant_of(m) for m, _ in tiles]
    bounds = [0] * (NUM_VARIANTS + 1)
    for v in range(NUM_VARIANTS):
        end = 0
        for t, variant in enumerate(variants):
            if variant <= v:
                end = tile_indptr[t + 1]
        bounds[v + 1] = end
    return bounds


def variant_mask(heights: tuple[int, ...] | list[int] | set[int]) -> int:
    """Bit ``v`` set for every variant the tile heights run on."""
    mask = 0
    for m in heights:
        mask |= 1 << variant_of(m)
    return mask


def packed_heads(
    max_rows: int,
    num_kv_heads: int,
    num_items: int | None = None,
    min_pairs: int = 0,
    tile_rows: int = VARIANT_ROWS[LEAF_VARIANT],
) -> int:
    """KV heads per pair of the smallest query tile, for items of at most ``max_rows`` rows.

    The 16-row kernel stacks the rows of several KV heads of one item in one tile and streams
    those heads' KV one after another, so a short item (one decode token of a GQA group of 4:
    4 rows) costs one pair per 4 KV heads instead of one per head. The count is the largest
    power of two whose rows fit the tile and that divides the KV heads; 1 when nothing fits.
    Packing also divides the launch's pairs, so with ``num_items`` given it stops before the
    launch would run fewer than ``min_pairs`` pairs (the SMs it should keep busy): a few long
    requests keep one pair per KV head.

    Worked example: 4 rows, 8 KV heads -> 4 (16 rows, pairs of heads 0-3 and 4-7); 3 rows,
    8 KV heads -> 4 (12 rows); 8 rows, 8 KV heads -> 2; 5 rows, 6 KV heads -> 2; 9 rows -> 1.
    4 rows, 8 KV heads, 64 items, at least 132 pairs -> 2 (256 pairs; 4 heads would leave 128).
    """
    heads = 1
    if max_rows <= 0:
        return heads
    while 2 * heads * max_rows <= tile_rows and num_kv_heads % (2 * heads) == 0:
        if num_items is not None and num_items * num_kv_heads // (2 * heads) < min_pairs:
            break
        heads *= 2
    return heads
