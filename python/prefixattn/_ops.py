"""The compiled attention ops: loading, fake (meta) registrations and thin checked wrappers.

``cuda_ops_available()`` says whether the CUDA kernels can run here (library built with CUDA and
a CUDA device present); ``run_plan_cuda`` executes a :class:`~prefixattn.plan.LaunchPlan` with
them. ``run_plan_cuda`` does no host work proportional to the batch, never synchronises, and
allocates only when a plan needs more scratch than the :class:`Workspace` holds, so after a
warm-up call it can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .plan import LaunchPlan

__all__ = ["Workspace", "cuda_ops_available", "run_plan_cuda"]


def _has_op(name: str) -> bool:
    return hasattr(torch.ops, "prefixattn") and hasattr(torch.ops.prefixattn, name)


@functools.lru_cache(maxsize=1)
def _load() -> bool:
    """Load the compiled library once; True when the ``run_plan`` schema is registered."""
    if not _has_op("run_plan"):
        from .native_plan import _candidates, load_library

        for path in _candidates():
            if not load_library(path):
                continue
            if _has_op("run_plan"):
                break
    if not _has_op("run_plan"):
        return False
    _register_fake()
    return True


def _register_fake() -> None:
    @torch.library.register_fake("prefixattn::run_plan")
    def _run_plan_fake(*args: object) -> None:
        return None


@functools.lru_cache(maxsize=1)
def cuda_ops_available() -> bool:
    """True when the library was built with the CUDA kernels and a CUDA device is present."""
    if not torch.cuda.is_available() or not _load():
        return False
    return bool(torch._C._dispatch_has_kernel_for_dispatch_key("prefixattn::run_plan", "CUDA"))


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


def run_plan_cuda(
    plan: LaunchPlan,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    workspace: Workspace,
    *,
    prefetch_tiles: int = 0,
    fixed_grid: bool = False,
    concurrent: bool = False,
    fixed_variants: int = -1,
    chained: bool = False,
    finish: bool = True,
    host_counts: bool | None = None,
) -> None:
    """Execute ``plan`` on CUDA tensors, writing ``out`` in place.

    q, out: [T, Hq, D] float16/bfloat16; k_cache, v_cache: NHD [pages, page_size, Hkv, D] or
    HND [pages, Hkv, page_size, D] (``plan.kv_layout``), any strides with a contiguous last
    dim, rows 16-byte aligned. Raises ``RuntimeError`` for combinations without a kernel.
    ``finish``: let the leaf launch run last and finish the plan's ``num_finished`` merged
    tokens (always with serial groups and the leaf kernel under a fixed grid, so a captured
    graph runs any plan either way); False, or concurrent groups, or
    ``PREFIXATTN_LEAF_KERNEL=0``: the merge launch takes every merged token.
    ``host_counts``: the plan's device ``counts`` hold what its host fields say, so launches
    that are not fixed grids take their item ranges from the host (one dependent load less
    as each block starts); default: unless the plan is hinted (its device check may zero
    them). Pass False for a plan whose counts are zeroed on the device (a hinted plan's
    fallback).
    """
    if not _load():
        raise RuntimeError("prefixattn: the compiled library (_C) is not available")
    moved = workspace.reserve(plan.num_partials, plan.num_qo_heads, plan.head_dim, q.dtype)
    if moved and q.is_cuda and torch.cuda.is_current_stream_capturing():
        # A graph captured now would keep the new buffer while the caller's earlier captures
        # keep the old one; size the workspace before capturing (PrefixAttention.reserve).
        raise RuntimeError(
            "prefixattn: the partials workspace had to grow or change dtype during CUDA-graph "
            "capture; reserve it before capturing"
        )
    torch.ops.prefixattn.run_plan(
        q,
        k_cache,
        v_cache,
        out,
        workspace.partial_o,
        workspace.partial_lse,
        plan.kv_page_indptr,
        plan.kv_pages,
        plan.kv_start,
        plan.kv_len,
        plan.q_indptr,
        plan.q_tokens,
        plan.q_limit,
        plan.q_out,
        plan.merge_tokens,
        plan.merge_indptr,
        plan.merge_partials,
        plan.counts,
        list(plan.tile_indptr),
        [m for m, _ in plan.tiles],
        plan.num_merge_tokens,
        plan.kv_layout == "HND",
        float(scale),
        int(prefetch_tiles),
        bool(fixed_grid),
        bool(concurrent),
        int(fixed_variants),
        bool(chained),
        int(plan.num_finished),
        bool(finish),
        int(plan.leaf_max_rows),
        int(plan.leaf_tiles),
        plan.fallback_taken is None if host_counts is None else bool(host_counts),
    )
