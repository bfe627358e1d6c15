"""Device homes for plan arrays: fixed addresses across steps, for CUDA graphs.

A ``PrefixAttention`` on a CUDA device keeps one buffer per plan array and copies each new
plan into them. A buffer only moves when a plan outgrows it (it then doubles and
``generation`` increases), so a CUDA graph captured over ``run`` keeps reading the current
plan as long as ``generation`` is unchanged; ``reserve`` sizes the buffers up front.

The host side stages every array in one pinned buffer; before that buffer is rewritten, the
previous plan's copies are waited for (they have normally finished long before).
"""

from __future__ import annotations

import numpy as np
import torch

COUNTS = ("num_work_items", "num_slots", "num_pages", "num_merge_tokens", "num_partials",
          "num_tokens")  # fmt: skip
"""Order of the first entries of the plan's ``counts`` device array."""

VARIANT_ROWS = (16, 32, 64, 128)
"""Query-tile heights of the CUDA kernel variants. ``counts[len(COUNTS) + v]`` ..
``counts[len(COUNTS) + v + 1]`` are the work items that run with height ``VARIANT_ROWS[v]``
(items are ordered by tile height), so kernels launched with a fixed grid read them."""

PACKED_HEADS = len(COUNTS) + len(VARIANT_ROWS) + 1
"""Index in ``counts`` of the KV heads one (item, KV heads) pair of the 16-row kernel covers
(see :func:`packed_heads`)."""

MERGE_OPEN = PACKED_HEADS + 1
"""Index in ``counts`` of the merged tokens the merge launch takes when the leaf launch
finishes the others (``num_merge_tokens - LaunchPlan.num_finished``)."""

COUNTS_LEN = MERGE_OPEN + 1
"""Entries of the ``counts`` array (the sizes, the variant bounds, the packed heads, the
merge launch's tokens)."""


def packed_heads(
    max_rows: int,
    num_kv_heads: int,
    num_items: int | None = None,
    min_pairs: int = 0,
    tile_rows: int = VARIANT_ROWS[0],
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


def variant_bounds(tiles: tuple[tuple[int, int], ...], tile_indptr: tuple[int, ...]) -> list[int]:
    """Item bounds per kernel variant from the plan's tile groups (ordered by height).

    Worked example: tiles ((16, 64), (16, 128), (128, 128)), tile_indptr (0, 3, 5, 6) ->
    [0, 5, 5, 5, 6]: items 0-4 run with 16 rows, item 5 with 128.
    """
    bounds = [0] * (len(VARIANT_ROWS) + 1)
    for v, rows in enumerate(VARIANT_ROWS):
        end = 0
        for t, (m, _) in enumerate(tiles):
            if m not in VARIANT_ROWS:
                raise ValueError(f"tile height {m} has no kernel variant ({VARIANT_ROWS})")
            if m <= rows:
                end = tile_indptr[t + 1]
        bounds[v + 1] = end
    return bounds


class PlanBuffers:
    """Per-array int32 device buffers plus a pinned staging buffer."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.generation = 0
        self._buffers: dict[str, torch.Tensor] = {}
        self._staging = torch.empty(0, dtype=torch.int32)
        self._copied: torch.cuda.Event | None = None

    def capacity(self, name: str) -> int:
        buf = self._buffers.get(name)
        return 0 if buf is None else buf.numel()

    def reserve(self, **sizes: int) -> None:
        """Make sure buffer ``name`` holds at least ``sizes[name]`` entries."""
        for name, size in sizes.items():
            if name not in self._buffers or self.capacity(name) < size:
                self._buffers[name] = torch.empty(
                    max(size, 2 * self.capacity(name), 64), dtype=torch.int32, device=self.device
                )
                self.generation += 1

    def load(self, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """Copy host int32 arrays into their buffers; returns views of the used prefixes."""
        self.reserve(**{name: len(a) for name, a in arrays.items()})
        total = sum(len(a) for a in arrays.values())
        if self._copied is not None:
            self._copied.synchronize()
        if self._staging.numel() < total:
            self._staging = torch.empty(max(total, 2 * self._staging.numel()), dtype=torch.int32,
                                        pin_memory=True)  # fmt: skip
        staging = self._staging.numpy()
        views: dict[str, torch.Tensor] = {}
        offset = 0
        for name, a in arrays.items():
            n = len(a)
            staging[offset : offset + n] = a
            dst = self._buffers[name][:n]
            dst.copy_(self._staging[offset : offset + n], non_blocking=True)
            views[name] = dst
            offset += n
        self._copied = torch.cuda.Event()
        self._copied.record()
        return views


def load_on_host(arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """CPU plans: tensors sharing the numpy arrays' memory."""
    return {
        name: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32))
        for name, a in arrays.items()
    }
