"""The checked wrapper of the compiled ``prefixattn::run_plan`` op.

:func:`run_plan` executes a :class:`~prefixattn.plan.types.LaunchPlan` on the CUDA kernels
(``prefixattn.runtime.library.cuda_ops_available()`` says whether they can run here). It does
no host work proportional to the batch, never synchronises, and allocates only when a plan
needs more scratch than the :class:`~prefixattn.runtime.buffers.Workspace` holds, so after a
warm-up call it can be captured in a CUDA graph.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .library import load_library

if TYPE_CHECKING:
    from ..options import LaunchOptions
    from ..plan.types import LaunchPlan
    from .buffers import Workspace

__all__ = ["run_plan"]


def run_plan(
    plan: LaunchPlan,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    workspace: Workspace,
    options: LaunchOptions,
    *,
    finish: bool = True,
    fixed_variants: int = -1,
    host_counts: bool | None = None,
) -> None:
    """Execute ``plan`` on CUDA tensors, writing ``out`` in place.

    q, out: [T, Hq, D] float16/bfloat16; k_cache, v_cache: NHD [pages, page_size, Hkv, D] or
    HND [pages, Hkv, page_size, D] (``plan.kv_layout``), any strides with a contiguous last
    dim, rows 16-byte aligned. Raises ``RuntimeError`` for combinations without a kernel.
    ``options``: the launch switches (``prefetch_tiles``, ``fixed_grid``,
    ``concurrent_groups``, ``chain_launches``; ``use_kernels`` is the caller's).
    ``finish``: let the leaf launch run last and finish the plan's ``num_finished`` merged
    tokens (always with serial groups and the leaf kernel under a fixed grid, so a captured
    graph runs any plan either way); False, or concurrent groups: the merge launch takes every
    merged token.
    ``fixed_variants`` >= 0: launch exactly these kernel variants (bit v: ``VARIANT_ROWS[v]``)
    and never concurrent groups (a hinted plan's fallback); -1: the variants of the plan.
    ``host_counts``: the plan's device ``counts`` hold what its host fields say, so launches
    that are not fixed grids take their item ranges from the host (one dependent load less
    as each block starts); default: unless the plan is hinted (its device check may zero
    them). Pass False for a plan whose counts are zeroed on the device (a hinted plan's
    fallback).
    """
    if not load_library():
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
        plan.kv_page_offset,
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
        int(options.prefetch_tiles),
        bool(options.fixed_grid),
        bool(options.concurrent_groups) and fixed_variants < 0,
        int(fixed_variants),
        bool(options.chain_launches),
        int(plan.num_finished),
        bool(finish),
        int(plan.leaf_max_rows),
        int(plan.leaf_tiles),
        plan.fallback_taken is None if host_counts is None else bool(host_counts),
    )
