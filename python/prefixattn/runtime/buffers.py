"""Device homes for plan arrays and the kernels' scratch: fixed addresses across steps, for
CUDA graphs.

A ``PrefixAttention`` on a CUDA device keeps one buffer per plan array and copies each new
plan into them. A buffer only moves when a plan outgrows it (it then doubles and
``generation`` increases), so a CUDA graph captured over ``run`` keeps reading the current
plan as long as ``generation`` is unchanged; ``reserve`` sizes the buffers up front.

The host side stages every array in one pinned buffer; before that buffer is rewritten, the
previous plan's copies are waited for (they have normally finished long before).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ..plan.layout import COUNTS_LEN
from ..plan.types import LaunchPlan


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

    def view(self, name: str, n: int) -> torch.Tensor:
        """The first ``n`` entries of buffer ``name`` (grown first where it is smaller), for
        an array the device fills itself."""
        self.reserve(**{name: n})
        return self._buffers[name][:n]

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
    from :func:`~prefixattn.plan.device_table.position_runs`), the positions are not copied
    from the host: the device expands the runs (entry ``i`` of run ``r`` stands for position
    ``i + run_delta[r]``), so the host ships O(runs), not O(pages).
    """
    num_pages = len(arrays["kv_pages"])
    if runs is not None:
        assert page_table is not None
        arrays = {n: a for n, a in arrays.items() if n != "kv_pages"}
        arrays["page_run_len"], arrays["page_run_delta"] = runs
    views = buffers().load(arrays) if device.type == "cuda" else load_on_host(arrays)
    if runs is not None:
        lens, deltas = views.pop("page_run_len"), views.pop("page_run_delta")
        if device.type == "cuda":
            views["kv_pages"] = buffers().view("kv_pages", num_pages)
        else:
            views["kv_pages"] = torch.empty(num_pages, dtype=torch.int32)
    elif page_table is not None and device.type != "cuda":  # keep the host arrays' positions
        views["kv_pages"] = views["kv_pages"].clone()
    if page_table is not None:
        pages = views["kv_pages"]
        if pages.numel():
            if runs is not None:
                pos = torch.arange(num_pages, device=pages.device) + torch.repeat_interleave(
                    deltas.long(), lens.long(), output_size=num_pages
                )
            else:
                pos = pages.long()
            width = page_table.shape[1]
            pages.copy_(page_table[pos // width, pos % width])
    return views


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
    a0, n = runs["a"], runs["n"]
    if not n.size:
        return torch.zeros((), dtype=torch.bool, device=device)
    width = block_table.shape[1]
    start = np.concatenate([[0], np.cumsum(n)]).astype(np.int64)
    total = int(start[-1])
    arrays = {"a": a0, "b": runs["b"], "n": n, "start": start[:-1].astype(np.int32)}
    v = state.check_buffers.load(arrays) if state is not None else load_on_host(arrays)
    seg = torch.repeat_interleave(
        torch.arange(n.size, device=device), v["n"].long(), output_size=total
    )
    off = torch.arange(total, device=device) - v["start"].long()[seg]
    pa = v["a"].long()[seg] + off
    pb = v["b"].long()[seg] + off
    pages_a = block_table[pa // width, pa % width]
    pages_b = block_table[pb // width, pb % width]
    return (pages_a != pages_b).any()


__all__ = [
    "HintedState",
    "PlanBuffers",
    "Workspace",
    "buffer_sizes",
    "load_on_host",
    "load_plan_arrays",
    "pages_differ",
]
