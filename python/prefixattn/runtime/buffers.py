"""Device homes for plan arrays and the kernels' scratch: fixed addresses across steps, for
CUDA graphs.

A ``PrefixAttention`` on a CUDA device keeps one buffer per plan array and copies each new
plan into them. A buffer only moves when a plan outgrows it (it then doubles and
``generation`` increases), so a CUDA graph captured over ``run`` keeps reading the current
plan as long as ``generation`` is unchanged; ``reserve`` sizes the buffers up front.

The host side stages every array in one pinned buffer; before that buffer is rewritten, the
previous plan's copies are waited for (they have normally finished long before). An array
that is the very host array loaded last time (a decode step's plan advanced from the last
one keeps most of its arrays) is not staged or copied again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..plan.layout import COUNTS_LEN
from ..plan.types import LaunchPlan


class PlanBuffers:
    """The plan's int32 device arrays, at fixed places in one device buffer, plus a pinned
    staging buffer of the same layout, so that loading a plan is one host-to-device copy.

    Each array has a capacity; an array that outgrows it doubles, and the whole buffer is laid
    out again (``generation`` increases: every array moved). The arrays a decode step changes
    go first, next to each other, and ``kv_pages`` last, so a plan whose page ids the device
    fills itself copies only the smaller arrays before it.
    """

    _FIRST = ("counts", "kv_len", "q_limit", "kv_page_offset", "page_run_len", "page_run_delta")
    _LAST = "kv_pages"
    _DEVICE_WRITTEN = frozenset({"counts", "kv_pages"})
    """Arrays the device changes after a load (hinted plans mask ``counts``; ``kv_pages`` is
    gathered in place): always copied."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.generation = 0
        self._capacity: dict[str, int] = {}
        self._offset: dict[str, int] = {}
        self._device = torch.empty(0, dtype=torch.int32, device=device)
        self._staging = torch.empty(0, dtype=torch.int32)
        self._copied: torch.cuda.Event | None = None
        self._loaded: dict[str, np.ndarray] = {}  # in the device buffer and in staging
        self._views: dict[tuple[str, int], torch.Tensor] = {}  # of the current buffer
        self.positions: tuple[tuple[Any, ...], torch.Tensor] | None = None
        """The last positions expanded from runs loaded here (:func:`load_plan_arrays`,
        :func:`pages_differ`) and their key."""

    def capacity(self, name: str) -> int:
        return self._capacity.get(name, 0)

    def reserve(self, **sizes: int) -> None:
        """Make sure array ``name`` holds at least ``sizes[name]`` entries."""
        grown = False
        for name, size in sizes.items():
            have = self._capacity.get(name)
            if have is None or have < size:
                self._capacity[name] = max(size, 2 * (have or 0), 64)
                grown = True
        if not grown:
            return
        first = {name: i for i, name in enumerate(self._FIRST)}
        names = sorted(self._capacity, key=lambda n: (n == self._LAST, first.get(n, len(first))))
        offset = 0
        for name in names:
            self._offset[name] = offset
            offset += self._capacity[name]
        self._device = torch.empty(offset, dtype=torch.int32, device=self.device)
        self._loaded.clear()
        self._views.clear()
        self.generation += 1

    def _slice(self, name: str, n: int) -> torch.Tensor:
        key = (name, n)
        view = self._views.get(key)
        if view is None:
            if len(self._views) >= 256:  # sizes change from batch to batch: keep few
                self._views.clear()
            o = self._offset[name]
            view = self._views[key] = self._device[o : o + n]
        return view

    def view(self, name: str, n: int) -> torch.Tensor:
        """The first ``n`` entries of array ``name`` (grown first where it is smaller), for
        an array the device fills itself."""
        self.reserve(**{name: n})
        return self._slice(name, n)

    def load(
        self, arrays: dict[str, np.ndarray], filled: dict[str, int] | None = None
    ) -> dict[str, torch.Tensor]:
        """Copy host int32 arrays into their places (one copy); returns views of the used
        prefixes. ``filled``: sizes of arrays the device will fill (reserved with the others,
        so that no later growth moves the arrays loaded here; use :meth:`view` for them)."""
        self.reserve(**{name: len(a) for name, a in arrays.items()}, **(filled or {}))
        if self._copied is not None:
            self._copied.synchronize()  # the staging buffer's previous copy has been read
        size = self._device.numel()
        if self._staging.numel() < size:
            self._staging = torch.empty(size, dtype=torch.int32, pin_memory=True)
            self._loaded.clear()
        staging = self._staging.numpy()
        views: dict[str, torch.Tensor] = {}
        lo, hi = size, 0
        loaded = self._loaded
        for name, a in arrays.items():
            o, n = self._offset[name], len(a)
            views[name] = self._slice(name, n)
            if loaded.get(name) is a:
                continue  # already there, and in staging
            if name in self._DEVICE_WRITTEN:
                loaded.pop(name, None)
            else:
                loaded[name] = a
            staging[o : o + n] = a
            if n:
                lo, hi = min(lo, o), max(hi, o + n)
        if hi > lo:
            self._device[lo:hi].copy_(self._staging[lo:hi], non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        return views


def load_on_host(arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """CPU plans: tensors sharing the numpy arrays' memory, except ``counts``, which a
    hinted plan masks in place (its host plan may be advanced for a later step)."""
    return {
        name: torch.from_numpy(
            np.array(a, dtype=np.int32) if name == "counts" else np.ascontiguousarray(a, np.int32)
        )
        for name, a in arrays.items()
    }


class Workspace:
    """Scratch owned by a ``PrefixAttention``: the partial output rows (in q's dtype) and their
    fp32 log-sum-exp.

    Buffers grow (doubling) only when a plan needs more, or change when q's dtype does; their
    addresses are otherwise stable, which keeps captured CUDA graphs valid.
    """

    def __init__(self, device: torch.device | str, dtype: torch.dtype = torch.bfloat16) -> None:
        self.device = torch.device(device)
        self.partial_o = torch.empty(0, dtype=dtype, device=self.device)
        self.partial_lse = torch.empty(0, dtype=torch.float32, device=self.device)

    def reserve(
        self, num_partials: int, num_qo_heads: int, head_dim: int, dtype: torch.dtype | None = None
    ) -> bool:
        """Make room for ``num_partials`` rows of [num_qo_heads, head_dim] (partial output in
        ``dtype``, by default the current one); True if a buffer moved (a captured CUDA graph
        that used the old one is stale)."""
        dtype = self.partial_o.dtype if dtype is None else dtype
        rows = max(num_partials, 1) * num_qo_heads
        moved = False
        if self.partial_lse.numel() < rows:
            rows = max(rows, 2 * self.partial_lse.numel())
            self.partial_lse = torch.empty(rows, dtype=torch.float32, device=self.device)
            moved = True
        size = self.partial_lse.numel() * head_dim
        if moved or self.partial_o.numel() < rows * head_dim or self.partial_o.dtype != dtype:
            self.partial_o = torch.empty(size, dtype=dtype, device=self.device)
            moved = True
        return moved


def buffer_sizes(w: int, p: int, s: int, t: int) -> dict[str, int]:
    """Plan buffer sizes for ``w`` items, ``p`` page ids, ``s`` slots and ``t`` tokens."""
    return dict(
        kv_page_offset=w, kv_pages=p, kv_start=w, kv_len=w, q_indptr=w + 1,
        q_tokens=s, q_limit=s, q_out=s, tile_id=w, merge_tokens=t, merge_indptr=t + 1,
        merge_partials=s, counts=COUNTS_LEN, page_run_len=w, page_run_delta=w,
    )  # fmt: skip


class HintedState:
    """Device state of hinted plans (``PrefixAttention.plan_hinted``): the fallback plan's
    buffers, the buffers of the device check's inputs, the fallback plan the launches read
    (the latest one loaded into ``buffers``, so its views are of the current buffers), and
    the kernel variants it may use (bit v: ``VARIANT_ROWS[v]``)."""

    def __init__(self, device: torch.device) -> None:
        self.buffers = PlanBuffers(device)
        self.check_buffers = PlanBuffers(device)
        self.plan: LaunchPlan | None = None
        self.variants = 0
        self.fixed = False
        """The variants are fixed (``reserve(hinted=True)``: CUDA graphs launch them)."""


def load_plan_arrays(
    arrays: dict[str, np.ndarray],
    device: torch.device,
    buffers: Callable[[], PlanBuffers],
    page_table: torch.Tensor | None = None,
    runs: tuple[np.ndarray, np.ndarray] | None = None,
) -> dict[str, torch.Tensor]:
    """The plan's int32 arrays on ``device``: copied into ``buffers()`` on a CUDA device,
    sharing the numpy memory on the CPU.

    With ``page_table`` (int32 [R, W]), ``arrays["kv_pages"]`` holds positions in it
    (row * W + column) that are replaced by its entries on its device, in stream order (no
    sync); the host array keeps the positions. With ``runs`` too (``run_len``, ``run_delta``,
    from :func:`~prefixattn.plan.device_table.position_runs`), ``arrays["kv_pages"]`` is
    not read (only its length) and the positions are not copied from the host: the device
    expands the runs (entry ``i`` of run ``r`` stands for position ``i + run_delta[r]``,
    clamped to the table), so the host ships O(runs), not O(pages). On a CUDA device the
    expansion is kept with ``buffers()`` and reused while the runs stay the same (the steps
    of a decode run whose pages did not move).
    """
    num_pages = len(arrays["kv_pages"])
    cuda = device.type == "cuda"
    target = buffers() if cuda else None
    cached = None
    if runs is not None:
        assert page_table is not None
        arrays = {n: a for n, a in arrays.items() if n != "kv_pages"}
        key = (runs[0].tobytes(), runs[1].tobytes(), page_table.shape, page_table.device)
        if target is not None and target.positions is not None and target.positions[0] == key:
            cached = target.positions[1]  # the last expansion, still valid
        else:
            arrays["page_run_len"], arrays["page_run_delta"] = runs
    if target is not None:
        views = target.load(arrays, {"kv_pages": num_pages} if runs is not None else None)
    else:
        views = load_on_host(arrays)
    if runs is not None:
        if target is not None:
            views["kv_pages"] = target.view("kv_pages", num_pages)
        else:
            views["kv_pages"] = torch.empty(num_pages, dtype=torch.int32)
    elif page_table is not None and not cuda:  # keep the host arrays' positions
        views["kv_pages"] = views["kv_pages"].clone()
    if page_table is not None:
        pages = views["kv_pages"]
        if pages.numel():
            if cached is not None:
                pos = cached
            elif runs is not None:
                lens, deltas = views.pop("page_run_len"), views.pop("page_run_delta")
                # Entry i of run r stands for position i + delta[r]; entries past an item's
                # pages (room for later steps) may pass the table's end: any valid position.
                pos = _expand(deltas, lens, num_pages)
                pos.clamp_(max=page_table.numel() - 1)
                if target is not None:
                    target.positions = (key, pos)
            else:
                pos = pages.clone()
            _gather_positions(page_table, pos, pages)
    views.pop("page_run_len", None)
    views.pop("page_run_delta", None)
    return views


_ARANGE: dict[torch.device, torch.Tensor] = {}


def _arange(n: int, device: torch.device) -> torch.Tensor:
    """``torch.arange(n)`` (int64) on ``device``, a view of a kept one where it is long
    enough (one op less per use)."""
    have = _ARANGE.get(device)
    if have is None or have.numel() < n:
        have = torch.arange(max(n, 2 * (0 if have is None else have.numel()), 1 << 16),
                            device=device)  # fmt: skip
        _ARANGE[device] = have
    return have[:n]


def _expand(deltas: torch.Tensor, lens: torch.Tensor, total: int) -> torch.Tensor:
    """int64 [total]: entry i of run r (``lens[r]`` entries each, in order) stands for
    position ``i + deltas[r]``, on the runs' device."""
    return _arange(total, deltas.device) + torch.repeat_interleave(deltas, lens, output_size=total)


def _gather_positions(table: torch.Tensor, pos: torch.Tensor, out: torch.Tensor) -> None:
    """``out[i] = table[pos[i] // W, pos[i] % W]`` for the [R, W] ``table``: one gather from
    its memory where it is contiguous, else by row and column."""
    if table.is_contiguous():
        torch.index_select(table.view(-1), 0, pos, out=out)
    else:
        width = table.shape[1]
        pos = pos.long()
        out.copy_(table[pos // width, pos % width])


def pages_differ(
    block_table: torch.Tensor,
    runs: dict[str, np.ndarray],
    state: HintedState | None,
    device: torch.device,
) -> torch.Tensor:
    """bool scalar on ``device``: some run of pages differs between two places of
    ``block_table`` (int32 [R, W]). ``runs``: int32 arrays ``a``, ``b`` (first positions,
    row * W + column, of the two runs) and ``n`` (pages of each run), all of one length; read
    in stream order, without a sync (on a CUDA device through ``state.check_buffers``)."""
    n = runs["n"]
    if not n.size:
        return torch.zeros((), dtype=torch.bool, device=device)
    key = (runs["a"].tobytes(), runs["b"].tobytes(), n.tobytes(), block_table.shape, device)
    last = None if state is None else state.check_buffers.positions
    if last is not None and last[0] == key:
        idx = last[1]  # the last check's positions (a decode run checks the same)
    else:
        start = np.cumsum(n, dtype=np.int64) - n
        total = int(start[-1] + n[-1])
        # The runs of a, then those of b: entry i of the 2 * total stands for position
        # i + delta of its run, delta = a - start or b - start - total.
        arrays = {
            "delta": np.concatenate([runs["a"] - start, runs["b"] - start - total]).astype(
                np.int32
            ),
            "n": np.concatenate([n, n]).astype(np.int32),
        }
        v = state.check_buffers.load(arrays) if state is not None else load_on_host(arrays)
        idx = _expand(v["delta"], v["n"], 2 * total)
        if state is not None:
            state.check_buffers.positions = (key, idx)
    pages = torch.empty(idx.numel(), dtype=block_table.dtype, device=device)
    _gather_positions(block_table, idx, pages)
    half = idx.numel() // 2
    return (pages[:half] != pages[half:]).any()


__all__ = [
    "HintedState",
    "PlanBuffers",
    "Workspace",
    "buffer_sizes",
    "load_on_host",
    "load_plan_arrays",
    "pages_differ",
]
