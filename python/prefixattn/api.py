"""The engine-facing API: ``PrefixAttention(...).plan(...)`` once per step, ``.run(...)`` per layer."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .buffers import (
    COUNTS_LEN,
    VARIANT_ROWS,
    PlanBuffers,
    load_on_host,
    packed_heads,
    variant_bounds,
)
from .forest import build_forest
from .native_plan import build_plan_native, native_plan_available
from .packer import (
    LEAF_PAIRS_PER_SM,
    LEAF_TILE_TOKENS,
    MIN_SPLIT_TOKENS,
    PACKINGS,
    BatchShape,
    finish_in_leaf,
    pack,
)
from .plan import LaunchPlan, PlanArrays
from .reference import run_plan_reference
from .tiles import SUPPORTED_HEAD_DIMS, TileTable, tile_table

KV_LAYOUTS = ("NHD", "HND")
MAX_PAGE_SIZE = 128
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
"""dtypes ``run`` accepts; the CUDA kernels take float16 and bfloat16, the reference all four."""

DEFAULT_SPLIT_TARGET = 132
"""``PrefixAttention.split_target`` of a plan built for a CPU device: the SM count of an
H100 / H200 SXM."""

DECODE_DEPTH_ALLOWANCE = 16
"""Prefix levels per request that :func:`decode_reservation` allows for (system prompt,
template, document, conversation turns, ...). Deeper forests are legal; a plan that then
outgrows a reservation bumps ``buffers_generation``."""


def decode_slots_per_token(
    max_context_len: int, max_requests: int, depth_allowance: int = DECODE_DEPTH_ALLOWANCE
) -> int:
    """(work item, token) slots one decode token can take in a plan.

    The work items a token joins cut its KV into pieces: one per forest node on its path (up
    to ``depth_allowance``) plus the long-KV split parts. A split part is never shorter than
    ``MIN_SPLIT_TOKENS``, so a token joins at most ``min(ceil(L / MIN_SPLIT_TOKENS), 2 * B)``
    extra parts (B requests make at most 2B - 1 forest nodes).
    """
    parts = min(2 * max_requests, -(-max_context_len // MIN_SPLIT_TOKENS)) + 1
    return depth_allowance + parts


def decode_reservation(
    max_requests: int,
    max_tokens: int,
    max_context_len: int,
    page_size: int,
    slots_per_token: int | None = None,
) -> dict[str, int]:
    """Sizes for :meth:`PrefixAttention.reserve` that no decode batch of up to
    ``max_requests`` requests and ``max_tokens`` query tokens, each with KV length at most
    ``max_context_len``, outgrows (CUDA-graph capture).

    ``slots_per_token`` defaults to :func:`decode_slots_per_token`. Every item holds at least
    one (item, token) slot; the page ids of all items add up to at most one read per request
    of its own pages (the query-centric total) plus one partial page per item.
    """
    if slots_per_token is None:
        slots_per_token = decode_slots_per_token(max_context_len, max_requests)
    slots = max_tokens * slots_per_token + 1024
    pages_per_request = -(-max_context_len // page_size) + 1
    return {
        "num_work_items": slots,
        "num_pages": max_requests * pages_per_request + slots,
        "num_slots": slots,
        "num_tokens": max_tokens,
    }


class PrefixAttention:
    """Prefix-aware paged attention for one model's attention shape.

    Build one per model (or per attention shape) and keep it: it owns the plan's device buffers.
    Each step, call :meth:`plan` once with the batch's block table and lengths; then call
    :meth:`run` in every layer with that layer's query and KV cache.

    Parameters
    ----------
    num_qo_heads, num_kv_heads:
        Query and KV heads; ``num_qo_heads`` must be a multiple of ``num_kv_heads``
        (group sizes 1 to 16).
    head_dim:
        64, 128 or 256.
    page_size:
        Tokens per KV page, 1 to 128.
    kv_layout:
        ``"NHD"``: caches are [num_pages, page_size, num_kv_heads, head_dim];
        ``"HND"``: [num_pages, num_kv_heads, page_size, head_dim]. Any strides are accepted
        as long as the last dimension is contiguous.
    device:
        Where plans put their index arrays (default: CPU).
    dtype:
        Element type of q and the caches; it sets the byte accounting and the packer's cost
        model, and ``run`` checks it.
    """

    def __init__(
        self,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        *,
        kv_layout: str = "NHD",
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        for name, value in (
            ("num_qo_heads", num_qo_heads),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("page_size", page_size),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if num_qo_heads % num_kv_heads:
            raise ValueError(
                f"num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        if num_qo_heads // num_kv_heads > 16:
            raise ValueError(
                f"GQA group size {num_qo_heads // num_kv_heads} is not supported (at most 16)"
            )
        if head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(
                f"unsupported head_dim {head_dim}; supported: "
                + ", ".join(map(str, SUPPORTED_HEAD_DIMS))
            )
        if page_size > MAX_PAGE_SIZE:
            raise ValueError(f"page_size {page_size} is larger than {MAX_PAGE_SIZE}")
        if kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")
        if dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"unsupported dtype {dtype}; expected one of {SUPPORTED_DTYPES}")
        self.num_qo_heads = num_qo_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.page_size = page_size
        self.kv_layout = kv_layout
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"device {self.device} requested but CUDA is not available")
        self.dtype = dtype
        self.tiles = tile_table(head_dim)
        self._shape = BatchShape(
            num_qo_heads, num_kv_heads, head_dim, torch.empty(0, dtype=dtype).element_size()
        )
        self._plan: LaunchPlan | None = None
        self._buffers: PlanBuffers | None = None
        self._workspace: Any = None
        self._guard: _Guard | None = None
        self.use_kernels = True
        """Run plans on the CUDA kernels when they are built (CUDA fp16/bf16 tensors)."""
        self.prefetch_tiles = 0
        """CUDA kernels: prefetch KV into L2 this many 64-token tiles ahead of the copies
        (``cp.async.bulk.prefetch.L2``); 0 turns it off (see docs/kernel-notes.md)."""
        self.fixed_grid = False
        """CUDA kernels: launch the plan-independent grids used under graph capture even when
        not capturing (for tests and measurements)."""
        self.concurrent_groups = False
        """CUDA kernels: run the tile groups (one launch per query-tile height) on forked
        streams at once instead of one after another on the caller's stream (not measured
        yet; see docs/kernel-notes.md)."""
        self.chain_launches = True
        """CUDA kernels: let each launch of a call after the first (the next tile height, the
        merge) start while the one before it drains (programmatic dependent launch), so the
        launches overlap at their tails; off, each waits for the one before to finish. On by
        default since the leaf kernel: 6.4% less time over the suite, at worst 1.0% more on
        one configuration (docs/kernel-notes.md, v17 and "Chained launches with the leaf
        kernel")."""
        self.native_plan = True
        """Build plans with the compiled planner when it is installed (identical output to
        the Python ``build_forest`` + ``pack``, which is used otherwise or when False)."""
        self.split_target: int | None = None
        """(work item, KV head) pairs the GPU runs at once; None (default): the device's SM
        count, read at the first plan (``DEFAULT_SPLIT_TARGET`` for a CPU device). A long row
        chunk is split only where its KV is more than twice its launch's KV tokens per SM
        (``prefixattn.packer``); 0 splits every long item."""
        self.pack_heads = True
        """Let the 16-row kernel cover several KV heads per (item, KV head) pair where the
        items' rows fit and the launch keeps at least ``split_target`` pairs
        (``prefixattn.buffers.packed_heads``): fewer, larger pairs for short decode items
        (docs/kernel-notes.md, v14). False: one KV head per pair."""
        self.finish_in_leaf = os.environ.get("PREFIXATTN_FINISH_IN_LEAF", "1") != "0"
        """Plans let the leaf kernel (16-row tiles, head_dim <= 128) finish the merged tokens
        with exactly one slot in its items: the CUDA launcher then runs the leaf launch after
        the other forward launches, and its warps merge those tokens' other partial rows into
        the output, so the merge launch takes only the rest (``prefixattn.packer.
        finish_in_leaf``; docs/kernel-notes.md, v25). False: every merged token goes through
        the merge launch, and the leaf launch runs first."""
        self.one_launch_in_one_wave = True
        """When all (work item, KV head) pairs of a plan fit in one wave (at most
        ``split_target``), give every item the plan's largest tile height, so that the
        forward kernels run as one launch instead of one per height (docs/kernel-notes.md,
        v8). False: each item keeps its own tile height."""

    cuda_graph_safe = True
    """With the CUDA kernels, :meth:`run` may be captured in a CUDA graph: under capture it
    launches grids that fill the device and read every size from the plan's device arrays, so
    a replay runs whatever plan :meth:`plan` last wrote into the same buffers (valid while
    :attr:`buffers_generation` is unchanged; q, the caches and ``out`` must be the captured
    tensors, and the plan must have the captured number of tokens)."""

    @property
    def buffers_generation(self) -> int:
        """Bumped whenever a plan outgrows the device buffers its arrays live in, or the
        partials scratch (CUDA only).

        A CUDA graph captured over :meth:`run` stays valid across plans while this value is
        unchanged; call :meth:`reserve` before capturing to size the buffers for the largest
        batch.
        """
        main = 0 if self._buffers is None else self._buffers.generation
        # Both only grow, so their sum changes whenever either does.
        return main + (0 if self._guard is None else self._guard.buffers.generation)

    def reserve(
        self,
        num_work_items: int,
        num_pages: int,
        num_slots: int,
        num_tokens: int,
        *,
        hinted: bool = False,
    ) -> None:
        """Size the plan's device buffers and the partials scratch (CUDA devices) for
        plans up to these counts.

        num_work_items: work items; num_pages: page ids over all items (at most the query-
        centric total); num_slots: (item, token) pairs; num_tokens: tokens per step.
        hinted: also set up (and size) the fallback of :meth:`plan_hinted`, so that every
        :meth:`run` from now on, and every CUDA graph captured over it, also launches the
        fallback plan (empty unless a hinted plan's check failed). Needed before capturing
        graphs that will replay hinted plans.
        """
        if self.device.type != "cuda":
            return
        if self._buffers is None:
            self._buffers = PlanBuffers(self.device)
        sizes = _buffer_sizes(num_work_items, num_pages, num_slots, num_tokens)
        self._buffers.reserve(**sizes)
        if hinted:
            guard = self._enable_guard()
            guard.buffers.reserve(**sizes)
            # Reload the empty fallback: the graphs captured next must read the reserved
            # buffers, not the ones they replaced.
            guard.plan = self._empty_fallback(guard)
        # Every partial row is one (item, token) slot, so slots bound the partials.
        self._reserve_workspace(num_slots)

    def _enable_guard(self) -> _Guard:
        """The fallback state of hinted plans (created once, with an empty fallback plan)."""
        if self._guard is not None:
            return self._guard
        guard = _Guard(self.device)
        self._guard = guard
        guard.plan = self._empty_fallback(guard)
        # A fallback plan (one decode token per request, no split) only ever uses the tile
        # height of one token's rows, and has no merge.
        height = self.tiles.select(self.num_qo_heads // self.num_kv_heads, 1)[0]
        guard.variants = 1 << VARIANT_ROWS.index(height)
        return guard

    def _empty_fallback(self, guard: _Guard) -> LaunchPlan:
        """A fallback plan with zero counts, loaded into the guard's buffers."""
        one = np.ones(1, np.int64)
        plan = self._plan_host(
            np.zeros((1, 1), np.int32), one, np.arange(2, dtype=np.int64), "per_query", False,
            buffers=guard.buffers, remember=False,
        )  # fmt: skip
        plan.counts.zero_()
        return plan

    def _quiet_fallback(self) -> None:
        """A plan that is not hinted was loaded: the fallback launches must do nothing."""
        if self._guard is not None and self._guard.plan is not None:
            self._guard.plan.counts.zero_()

    def _reserve_workspace(self, num_partials: int) -> None:
        from . import _ops

        if self._workspace is None:
            self._workspace = _ops.Workspace(self.device, self.dtype)
        if self._workspace.reserve(num_partials, self.num_qo_heads, self.head_dim, self.dtype):
            if self._buffers is None:
                self._buffers = PlanBuffers(self.device)
            self._buffers.generation += 1

    @property
    def last_plan(self) -> LaunchPlan | None:
        """The plan :meth:`run` uses (the last one :meth:`plan` built)."""
        return self._plan

    # ------------------------------------------------------------------ plan
    def plan(
        self,
        block_table: torch.Tensor | np.ndarray,
        seq_lens: torch.Tensor | np.ndarray,
        qo_indptr: torch.Tensor | np.ndarray | None = None,
        *,
        packing: str = "memory",
        split_kv: bool = True,
    ) -> LaunchPlan:
        """Build the step's launch plan (host work; not for CUDA-graph capture).

        Parameters
        ----------
        block_table:
            int32 [B, max_pages]; row b's first ``ceil(seq_lens[b] / page_size)`` entries are
            its pages, later entries are ignored. Equal leading entries mean shared KV.
        seq_lens:
            int32 [B]; KV length of each request, including its new tokens.
        qo_indptr:
            int32 [B+1]; request b's new tokens are rows ``qo_indptr[b]:qo_indptr[b+1]`` of
            ``q``. None means one new token per request (decode).
        packing:
            ``"memory"`` (prefix-aware, default), ``"naive"`` (one work item per forest node) or
            ``"per_query"`` (one per request: the query-centric baseline).
        split_kv:
            Split work items longer than the batch mean into equal parts.

        Device tensors are copied to the host (one sync); engines that keep host copies of
        their block tables should pass those.
        """
        if not isinstance(split_kv, bool):
            raise TypeError(f"split_kv must be a bool, got {type(split_kv).__name__}")
        table = _host_int_array("block_table", block_table, ndim=2, keep_dtype=True)
        lens = _host_int_array("seq_lens", seq_lens, ndim=1).astype(np.int64, copy=False)
        b = table.shape[0]
        if lens.shape[0] != b:
            raise ValueError(f"seq_lens has {lens.shape[0]} entries but block_table has {b} rows")
        indptr = _host_qo_indptr(qo_indptr, b)
        if packing not in PACKINGS:
            raise ValueError(f"unknown packing {packing!r}; expected one of {', '.join(PACKINGS)}")
        _check_lengths(table, lens, indptr, self.page_size)
        table = _int32_page_ids(table, lens, indptr, self.page_size)
        plan = self._plan_host(table, lens, indptr, packing, split_kv)
        self._quiet_fallback()
        return plan

    def plan_unshared(
        self,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor | np.ndarray,
        qo_indptr: torch.Tensor | np.ndarray | None = None,
        *,
        rows: torch.Tensor | np.ndarray | None = None,
        split_kv: bool = True,
    ) -> LaunchPlan:
        """A plan that reads no page id on the host, so it never waits for the GPU.

        Every request gets work items of its own (the ``per_query`` packing: shared pages,
        if any, are read once per request). The items' page ids are taken from
        ``block_table`` on its device, after the plan's arrays are loaded and in stream
        order. The result is correct for any batch; an engine uses it for steps where it
        expects no sharing (for example when the last step it looked at had none), and
        :meth:`plan` otherwise.

        Parameters
        ----------
        block_table:
            int32 tensor [R, W] on this object's device, last dimension contiguous (a slice
            of rows of an engine's larger table is fine). Its page ids are not checked on the
            host: they must be valid pages of the caches passed to :meth:`run`.
        seq_lens, qo_indptr:
            Host arrays as in :meth:`plan`.
        rows:
            Host int array [B]: the row of ``block_table`` request b reads (default b), e.g.
            any real row for an engine's padding requests.
        """
        if not isinstance(split_kv, bool):
            raise TypeError(f"split_kv must be a bool, got {type(split_kv).__name__}")
        lens, indptr, row_of, cols = self._device_table_inputs(
            block_table, seq_lens, qo_indptr, rows
        )
        # Positions as page ids: rows never share one, so the forest has no sharing.
        positions = _table_positions(row_of, block_table.shape[1], cols)
        _check_lengths(positions, lens, indptr, self.page_size)
        plan = self._plan_host(
            positions, lens, indptr, "per_query", split_kv, page_table=block_table
        )
        self._quiet_fallback()
        return plan

    def plan_hinted(
        self,
        block_table: torch.Tensor,
        hint: torch.Tensor | np.ndarray,
        seq_lens: torch.Tensor | np.ndarray,
        qo_indptr: torch.Tensor | np.ndarray | None = None,
        *,
        rows: torch.Tensor | np.ndarray | None = None,
        private: torch.Tensor | np.ndarray | None = None,
    ) -> LaunchPlan:
        """A prefix-aware decode plan whose forest comes from a host ``hint`` of the block
        table (for example the previous step's copy), so it never waits for the GPU.

        The hint only decides which requests share which pages. Every page id the kernels read
        is taken from ``block_table`` on its device, in stream order; a device check then
        compares, for every work item, the pages of each of its requests with those of the
        request it reads them from. If any differ (the hint was stale: rows were reordered,
        replaced or rewritten), the plan's launches do nothing and a per-request plan (as
        :meth:`plan_unshared`, no split) that was loaded beside it runs instead. The result
        is correct for any hint; a good hint makes it as fast as :meth:`plan`.

        Parameters
        ----------
        block_table:
            int32 tensor [R, W] on this object's device, last dimension contiguous (as in
            :meth:`plan_unshared`).
        hint:
            Host int array [R', W'] believed to equal ``block_table``'s first R' rows on its
            first W' columns; negative entries mean unknown (e.g. pages a request gained since
            the copy). Rows and columns it lacks are unknown too; unknown pages are private.
        seq_lens, qo_indptr, rows:
            As in :meth:`plan_unshared`; at most one new token per request (decode steps).
        private:
            Host bool array [B]: requests whose pages the hint does not describe (e.g. an
            engine's padding requests, which read some real row): planned as sharing nothing.

        On a CUDA device the first call sets up the fallback's buffers (see :meth:`reserve`,
        ``hinted``); from then on every :meth:`run` also launches the fallback plan, which is
        empty unless a hinted plan's check failed.
        """
        lens, indptr, row_of, cols = self._device_table_inputs(
            block_table, seq_lens, qo_indptr, rows
        )
        q_lens = np.diff(indptr)
        if (q_lens > 1).any():
            r = int(np.flatnonzero(q_lens > 1)[0])
            raise ValueError(
                f"plan_hinted plans decode steps (at most one new token per request), but "
                f"request {r} has {int(q_lens[r])}; plan this step with plan() or plan_unshared()"
            )
        hint_arr = _host_int_array("hint", hint, ndim=2)
        b, width, ps = lens.shape[0], block_table.shape[1], self.page_size
        # The planning table (int32, one pass per step over its B x cols entries at most):
        # hinted page ids where known, a unique id past them elsewhere.
        base = max(int(hint_arr.max(initial=-1)), -1) + 1
        if base + b * cols > np.iinfo(np.int32).max:
            raise ValueError(f"hint holds page id {base - 1}, too large to plan with (int32)")
        table = np.full((b, cols), -1, np.int32)
        known = row_of < hint_arr.shape[0]
        if private is not None:
            mask = np.asarray(private.cpu() if isinstance(private, torch.Tensor) else private)
            if mask.dtype != np.bool_ or mask.shape != (b,):
                raise ValueError(
                    f"private must be a bool array of shape ({b},), got {mask.dtype} "
                    f"{tuple(mask.shape)}"
                )
            known &= ~mask
        hc = min(cols, hint_arr.shape[1])
        n_known = int(np.argmin(known)) if not known.all() else b
        if (
            known[:n_known].all()
            and not known[n_known:].any()
            and np.array_equal(row_of[:n_known], np.arange(n_known))
        ):
            table[:n_known, :hc] = hint_arr[:n_known, :hc]  # the usual case: rows in order
        else:
            table[known, :hc] = hint_arr[row_of[known], :hc]
        flat = table.reshape(-1)
        unknown = np.flatnonzero(flat < 0)
        flat[unknown] = base + unknown
        _check_lengths(table, lens, indptr, ps)
        positions = _table_positions(row_of, width, cols)
        guard = self._enable_guard() if self.device.type == "cuda" else None
        fallback = self._plan_host(
            positions, lens, indptr, "per_query", False, page_table=block_table,
            buffers=None if guard is None else guard.buffers, remember=False,
        )  # fmt: skip
        if guard is not None:
            # From now on the launches read the fallback through views of the buffers as they
            # are now (they may have grown for this plan).
            guard.plan = fallback
            used = {VARIANT_ROWS.index(m) for m, _ in fallback.tiles}
            if fallback.num_merge_tokens or any(not (guard.variants >> v) & 1 for v in used):
                raise RuntimeError(
                    f"prefixattn internal error: the fallback plan uses tiles {fallback.tiles} "
                    f"and {fallback.num_merge_tokens} merges, outside its launches"
                )
        primary = self._plan_host(
            table, lens, indptr, "memory", True, page_table=block_table,
            positions_of=lambda host: _hint_positions(host, indptr, row_of, width, ps),
        )  # fmt: skip
        a0, b0, n = _hint_checks(primary.host, indptr, row_of, width, ps)
        taken = torch.zeros((), dtype=torch.bool, device=self.device)
        if n.size:
            start = np.concatenate([[0], np.cumsum(n)]).astype(np.int64)
            total = int(start[-1])
            arrays = {"a": a0, "b": b0, "n": n, "start": start[:-1].astype(np.int32)}
            v = guard.check_buffers.load(arrays) if guard is not None else load_on_host(arrays)
            seg = torch.repeat_interleave(
                torch.arange(n.size, device=self.device), v["n"].long(), output_size=total
            )
            off = torch.arange(total, device=self.device) - v["start"].long()[seg]
            pa = v["a"].long()[seg] + off
            pb = v["b"].long()[seg] + off
            pages_a = block_table[pa // width, pa % width]
            pages_b = block_table[pb // width, pb % width]
            taken = (pages_a != pages_b).any()
        primary.counts.mul_((~taken).to(torch.int32))
        fallback.counts.mul_(taken.to(torch.int32))
        plan = dataclasses.replace(primary, fallback=fallback, fallback_taken=taken)
        self._plan = plan
        return plan

    def _device_table_inputs(
        self,
        block_table: Any,
        seq_lens: Any,
        qo_indptr: Any,
        rows: Any,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """Checked (lens, qo_indptr, row of each request, columns used) of plans that read
        page ids from a device table."""
        if not isinstance(block_table, torch.Tensor):
            raise TypeError(
                f"block_table must be a torch.Tensor on {self.device}, got "
                f"{type(block_table).__name__}"
            )
        if block_table.dtype != torch.int32:
            raise TypeError(f"block_table must be an int32 tensor, got {block_table.dtype}")
        if block_table.dim() != 2:
            raise ValueError(f"block_table must be 2-D, got shape {tuple(block_table.shape)}")
        if block_table.device != self.device and not (
            block_table.is_cuda and self.device.type == "cuda" and self.device.index is None
        ):
            raise ValueError(f"block_table is on {block_table.device}, expected {self.device}")
        if block_table.shape[1] > 1 and block_table.stride(1) != 1:
            raise ValueError("block_table must have a contiguous last dimension")
        lens = _host_int_array("seq_lens", seq_lens, ndim=1).astype(np.int64, copy=False)
        b = lens.shape[0]
        indptr = _host_qo_indptr(qo_indptr, b)
        if rows is None:
            row_of = np.arange(b, dtype=np.int64)
        else:
            row_of = _host_int_array("rows", rows, ndim=1).astype(np.int64, copy=False)
            if row_of.shape[0] != b:
                raise ValueError(f"rows has {row_of.shape[0]} entries but seq_lens has {b}")
        num_rows, width = block_table.shape
        if b and (row_of.min() < 0 or row_of.max() >= num_rows):
            r = int(np.flatnonzero((row_of < 0) | (row_of >= num_rows))[0])
            raise IndexError(
                f"rows[{r}] = {int(row_of[r])} is outside block_table's {num_rows} rows"
            )
        cols = max(1, -(-int(lens.max(initial=0)) // self.page_size))
        if cols > width:
            r = int(np.argmax(lens))
            raise ValueError(
                f"seq_lens[{r}] = {int(lens[r])} needs {cols} pages but block_table rows hold "
                f"{width} (page_size {self.page_size})"
            )
        # The host plans with positions in the table (row * W + column) standing for page ids;
        # the device maps positions to ids.
        if num_rows * width > np.iinfo(np.int32).max:
            raise ValueError(f"block_table has {num_rows * width} entries, more than int32 holds")
        return lens, indptr, row_of, cols

    def _plan_host(
        self,
        table: np.ndarray,
        lens: np.ndarray,
        indptr: np.ndarray,
        packing: str,
        split_kv: bool,
        page_table: torch.Tensor | None = None,
        *,
        positions_of: Callable[[PlanArrays], np.ndarray] | None = None,
        buffers: PlanBuffers | None = None,
        remember: bool = True,
    ) -> LaunchPlan:
        """The plan of checked host inputs; with ``page_table``, the page array loaded holds
        positions in it (row * width + column) that are replaced by its entries on the device:
        ``table``'s own entries, or ``positions_of(host arrays)``. ``buffers``: where the
        arrays go on a CUDA device (default: this object's); ``remember``: make it the plan
        :meth:`run` uses by default."""
        b = table.shape[0]

        if self.split_target is None:
            self.split_target = _split_target(self.device)
        if not isinstance(self.split_target, int) or self.split_target < 0:
            raise ValueError(
                f"split_target must be a non-negative int (0: split every long item), got "
                f"{self.split_target!r}"
            )

        target: int = self.split_target

        # The forest is built once per call: the Python planner keeps it here, the compiled one
        # in the op's per-thread state (reuse_forest for every build after the first).
        forests: list[Any] = []
        # The leaf launch finishes the merged tokens it can (packer.finish_in_leaf): in the
        # compiled op's call when it plans, else on the Python plan below.
        finish = self.finish_in_leaf and self.head_dim <= 128
        leaf_warps = _split_target(self.device) * LEAF_PAIRS_PER_SM if finish else 0

        def build(table_of_tiles: TileTable) -> tuple[Any, Any, Any, Any, Any]:
            if self.native_plan and native_plan_available():
                built = build_plan_native(
                    table, lens, indptr, self.page_size, self._shape, table_of_tiles, packing,
                    split_kv, target, reuse_forest=bool(forests), finish_leaf_warps=leaf_warps,
                )  # fmt: skip
                forests.append(built[0])
                return built
            if not forests:
                # Requests without new tokens (padding) take no part in the forest.
                live = np.where(np.diff(indptr) > 0, lens, 0)
                forests.append(build_forest(table, live, self.page_size))
            forest = forests[0]
            return forest, *pack(
                forest, table, lens, indptr, self._shape, table_of_tiles, packing, split_kv,
                target,
            )  # fmt: skip

        forest, host, tiles, tile_indptr, acc = build(self.tiles)
        used = self.tiles
        narrow = self.tiles.narrow()
        if narrow is not None and max((m for m, _ in tiles), default=0) > self.tiles.m_sizes[0]:
            # The narrow plan (no 128-row tiles) where it moves at most narrow_traffic times
            # the KV and partial-row bytes. A plan of smallest tiles alone (every item of at
            # most 16 rows: no sharing, small groups) is the same with either table.
            alt = build(narrow)
            moved = acc["kv_bytes"] + acc["partial_bytes"]
            if alt[4]["kv_bytes"] + alt[4]["partial_bytes"] <= self.tiles.narrow_traffic * moved:
                forest, host, tiles, tile_indptr, acc = alt
                used = narrow
        took_narrow = used is narrow
        heights = sorted({m for m, _ in tiles})
        pairs = len(host.kv_len) * self.num_kv_heads
        if self.one_launch_in_one_wave and len(heights) > 1 and pairs <= target:
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
            forest, host, tiles, tile_indptr, acc = build(one)
        bounds = variant_bounds(tiles, tile_indptr)
        leaf_rows = np.diff(host.q_indptr)[bounds[0] : bounds[1]]
        leaf_max_rows = int(leaf_rows.max(initial=0)) * self._shape.group_size
        leaf_len = host.kv_len[bounds[0] : bounds[1]].astype(np.int64)
        leaf_tiles = int((-(-leaf_len // LEAF_TILE_TOKENS)).sum())
        num_finished = int(acc.get("num_finished", 0))
        if finish and "num_finished" not in acc:
            # Merged tokens with one slot in the leaf kernel's items (the 16-row variant): that
            # item finishes them (the leaf launch runs last and merges their other rows itself).
            leaf = np.zeros(len(host.kv_len), dtype=bool)
            leaf[bounds[0] : bounds[1]] = True
            host, num_finished = finish_in_leaf(
                host, leaf, int(indptr[-1]), self.num_kv_heads, leaf_warps
            )
        _check_pages(host.kv_pages, table, lens, indptr, self.page_size)
        num_tokens = int(indptr[-1])
        max_page_id = int(host.kv_pages.max(initial=-1))
        shape = self._shape
        distinct_tokens = int(
            (forest.token_end - forest.page_begin.astype(np.int64) * self.page_size).sum()
        )
        qo_bytes = 2 * num_tokens * self.num_qo_heads * self.head_dim * shape.elem_bytes
        heads = 1
        if self.pack_heads and bounds[1] > bounds[0]:
            # As many KV heads per pair as the 16-row items' rows allow, while the launch
            # keeps at least one pair per SM.
            sms = target if target > 0 else _split_target(self.device)
            heads = packed_heads(leaf_max_rows, self.num_kv_heads, bounds[1] - bounds[0], sms)
            assert leaf_max_rows * heads <= VARIANT_ROWS[0] and self.num_kv_heads % heads == 0
        counts = np.asarray(
            [len(host.kv_len), len(host.q_tokens), len(host.kv_pages), len(host.merge_tokens),
             acc["num_partials"], num_tokens, *bounds, heads,
             len(host.merge_tokens) - num_finished],
            dtype=np.int32,
        )  # fmt: skip
        arrays = {n: getattr(host, n) for n in _DEVICE_ARRAYS} | {"counts": counts}
        if positions_of is not None:
            arrays["kv_pages"] = positions_of(host)
        dev = self.device
        if dev.type == "cuda":
            if buffers is None:
                if self._buffers is None:
                    self._buffers = PlanBuffers(dev)
                buffers = self._buffers
            views = buffers.load(arrays)
            # The partials scratch grows here, on the host side of the step, so that
            # buffers_generation tells graph users about it before any replay.
            self._reserve_workspace(acc["num_partials"])
        else:
            views = load_on_host(arrays)
            if page_table is not None:  # keep the host arrays' positions
                views["kv_pages"] = views["kv_pages"].clone()
        if page_table is not None:
            # Positions -> page ids, on the table's device and in stream order (no sync).
            pages = views["kv_pages"]
            if pages.numel():
                pos = pages.long()
                width = page_table.shape[1]
                pages.copy_(page_table[pos // width, pos % width])
            max_page_id = -1  # not known on the host
        device_arrays: dict[str, Any] = {n: views[n] for n in _DEVICE_ARRAYS}
        plan = LaunchPlan(
            num_qo_heads=self.num_qo_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            page_size=self.page_size,
            kv_layout=self.kv_layout,
            packing=packing,
            split_kv=split_kv,
            batch_size=b,
            num_tokens=num_tokens,
            num_work_items=len(host.kv_len),
            num_partials=acc["num_partials"],
            num_merge_tokens=len(host.merge_tokens),
            max_page_id=max_page_id,
            tiles=tiles,
            tile_indptr=tile_indptr,
            num_ctas=len(host.kv_len) * self.num_kv_heads,
            kv_bytes=acc["kv_bytes"],
            partial_bytes=acc["partial_bytes"],
            distinct_kv_bytes=shape.kv_bytes(distinct_tokens),
            query_centric_kv_bytes=shape.kv_bytes(int(lens[np.diff(indptr) > 0].sum())),
            qo_bytes=qo_bytes,
            device=dev,
            **device_arrays,
            counts=views["counts"],
            host=host,
            forest=forest,
            num_finished=num_finished,
            leaf_max_rows=leaf_max_rows,
            leaf_tiles=leaf_tiles,
            narrow=took_narrow,
        )
        if remember:
            self._plan = plan
        return plan

    # ------------------------------------------------------------------- run
    def run(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        *,
        scale: float | None = None,
        out: torch.Tensor | None = None,
        plan: LaunchPlan | None = None,
    ) -> torch.Tensor:
        """Attention of the planned batch for one layer.

        Parameters
        ----------
        q:
            [T, Hq, D], T = ``qo_indptr[-1]`` of the plan; float16 or bfloat16 (CPU reference:
            also float32/float64), the dtype given to the constructor.
        k_cache, v_cache:
            Paged caches in ``kv_layout``, same dtype and device as ``q``; last dim contiguous.
        scale:
            Softmax scale; default ``1/sqrt(head_dim)``.
        out:
            Optional [T, Hq, D] output, written in place (caller-owned: CUDA-graph friendly).
        plan:
            The plan to run (default: the last one :meth:`plan` built).

        Returns ``out`` (or a new tensor). On CUDA float16/bfloat16 tensors, with a library
        built with the CUDA kernels, the plan runs on the kernels (no host sync, no allocation
        once the scratch is reserved; capturable in a CUDA graph, see :attr:`cuda_graph_safe`);
        otherwise the PyTorch reference executes it (``prefixattn.reference.run_plan_reference``).
        """
        plan = plan if plan is not None else self._plan
        if plan is None:
            raise RuntimeError("PrefixAttention.run called before plan()")
        self._check_run_inputs(plan, q, k_cache, v_cache, out)
        scale = 1.0 / math.sqrt(self.head_dim) if scale is None else _check_scale(scale)
        if out is None:
            out = torch.empty_like(q)
        if self.use_kernels and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
            from . import _ops  # loads the compiled library on first use

            if _ops.cuda_ops_available():
                if self._workspace is None:
                    self._workspace = _ops.Workspace(q.device, q.dtype)
                _ops.run_plan_cuda(
                    plan, q, k_cache, v_cache, out, scale, self._workspace,
                    prefetch_tiles=self.prefetch_tiles, fixed_grid=self.fixed_grid,
                    concurrent=self.concurrent_groups, chained=self.chain_launches,
                    finish=self.finish_in_leaf,
                )  # fmt: skip
                if self._guard is not None:
                    # The fallback of hinted plans: its counts are zero unless a check failed
                    # (then the plan above did nothing).
                    fallback = plan.fallback or self._guard.plan
                    assert fallback is not None
                    _ops.run_plan_cuda(
                        fallback, q, k_cache, v_cache, out, scale, self._workspace,
                        prefetch_tiles=self.prefetch_tiles, fixed_grid=self.fixed_grid,
                        fixed_variants=self._guard.variants, chained=self.chain_launches,
                        finish=self.finish_in_leaf, host_counts=False,
                    )  # fmt: skip
                return out
        if plan.fallback is not None and plan.fallback_taken is not None and plan.fallback_taken:
            plan = plan.fallback  # the hint's check failed
        return run_plan_reference(plan, q, k_cache, v_cache, out, scale)

    def _check_run_inputs(
        self,
        plan: LaunchPlan,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor | None,
    ) -> None:
        if not isinstance(plan, LaunchPlan):
            raise TypeError(f"plan must be a LaunchPlan, got {type(plan).__name__}")
        mine = (self.num_qo_heads, self.num_kv_heads, self.head_dim, self.page_size,
                self.kv_layout)  # fmt: skip
        theirs = (plan.num_qo_heads, plan.num_kv_heads, plan.head_dim, plan.page_size,
                  plan.kv_layout)  # fmt: skip
        if mine != theirs:
            names = ("num_qo_heads", "num_kv_heads", "head_dim", "page_size", "kv_layout")
            diff = ", ".join(
                f"{n} {b!r} vs {a!r}" for n, a, b in zip(names, mine, theirs, strict=True) if a != b
            )
            raise ValueError(f"the plan was built for another geometry than this object: {diff}")
        for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("out", out)):
            if not isinstance(t, torch.Tensor) and not (name == "out" and t is None):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if q.dim() != 3:
            raise ValueError(
                f"q must be 3-D [tokens, num_qo_heads, head_dim], got shape {tuple(q.shape)}"
            )
        expected_q = (plan.num_tokens, self.num_qo_heads, self.head_dim)
        if tuple(q.shape) != expected_q:
            raise ValueError(f"q has shape {tuple(q.shape)}, expected {expected_q} for this plan")
        if q.dtype != self.dtype:
            raise TypeError(
                f"q has dtype {q.dtype} but this PrefixAttention was built for {self.dtype}"
            )
        if q.stride(-1) != 1:
            raise ValueError("q must have a contiguous last dimension")
        if q.device.type != plan.device.type or (
            q.is_cuda and plan.device.index is not None and q.device.index != plan.device.index
        ):
            raise ValueError(f"q is on {q.device} but the plan's arrays are on {plan.device}")
        for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
            if name == "v_cache" and v_cache.dim() == 4 and v_cache.shape[0] != k_cache.shape[0]:
                raise ValueError(
                    f"k_cache has {k_cache.shape[0]} pages but v_cache has {v_cache.shape[0]}"
                )
            if cache.dim() != 4:
                raise ValueError(
                    f"{name} must be 4-D ({_layout_doc(self.kv_layout)}), got shape {tuple(cache.shape)}"
                )
            if self.kv_layout == "NHD":
                _, ps, hkv, d = cache.shape
            else:
                _, hkv, ps, d = cache.shape
            if (ps, hkv, d) != (self.page_size, self.num_kv_heads, self.head_dim):
                raise ValueError(
                    f"{name} has shape {tuple(cache.shape)}; expected {_layout_doc(self.kv_layout)} "
                    f"with page_size={self.page_size}, num_kv_heads={self.num_kv_heads}, "
                    f"head_dim={self.head_dim}"
                )
            if cache.dtype != q.dtype:
                raise TypeError(f"{name} has dtype {cache.dtype} but q has {q.dtype}")
            if cache.device != q.device:
                raise ValueError(f"{name} is on {cache.device} but q is on {q.device}")
            if cache.stride(-1) != 1:
                raise ValueError(f"{name} must have a contiguous last dimension (head_dim)")
            if plan.max_page_id >= cache.shape[0]:
                raise IndexError(
                    f"block_table refers to page {plan.max_page_id} but {name} has only "
                    f"{cache.shape[0]} pages"
                )
        if out is not None:
            if tuple(out.shape) != tuple(q.shape):
                raise ValueError(f"out has shape {tuple(out.shape)}, expected {tuple(q.shape)}")
            if out.dtype != q.dtype or out.device != q.device:
                raise TypeError(
                    f"out must match q's dtype and device ({q.dtype}, {q.device}), "
                    f"got ({out.dtype}, {out.device})"
                )
            if out.stride(-1) != 1:
                raise ValueError("out must have a contiguous last dimension")
            if any(st == 0 and n > 1 for st, n in zip(out.stride(), out.shape, strict=True)):
                raise ValueError(
                    "out has overlapping elements (a stride of 0): it cannot be written"
                )
            if out.requires_grad:
                raise ValueError("out requires grad; pass a tensor that does not (attention "
                                 "here is inference only)")  # fmt: skip


class CapturedBuffers:
    """Guards CUDA graphs captured over :meth:`PrefixAttention.run`: they read the plan
    buffers of the ``buffers_generation`` they were captured with, and a plan that outgrew
    those buffers (the generation changed) leaves them reading freed memory.

    Call :meth:`pin` when capturing (or right after :meth:`PrefixAttention.reserve`) and
    :meth:`check` after every plan a replay will read; both raise ``RuntimeError`` with
    ``remedy`` (what the engine's user can change) once the buffers moved.
    """

    def __init__(self, remedy: str) -> None:
        self.remedy = remedy
        self.captured_generation: int | None = None
        """``buffers_generation`` at the first :meth:`pin`; None before."""

    def pin(self, attention: PrefixAttention) -> None:
        gen = attention.buffers_generation
        if self.captured_generation is None:
            self.captured_generation = gen
        elif gen != self.captured_generation:
            raise RuntimeError(
                "prefixattn: the plan buffers grew between two CUDA graph captures "
                f"(generation {self.captured_generation} -> {gen}), so the graphs captured "
                f"first are stale. {self.remedy}"
            )

    def check(self, attention: PrefixAttention) -> None:
        gen = attention.buffers_generation
        if self.captured_generation is None or gen == self.captured_generation:
            return
        plan = attention.last_plan
        size = (
            ""
            if plan is None
            else f" ({plan.num_tokens} tokens, {plan.num_work_items} work items, "
            f"{len(plan.q_tokens)} query slots, {len(plan.kv_pages)} pages)"
        )
        raise RuntimeError(
            f"prefixattn: this step's plan{size} outgrew the buffers reserved for the "
            f"captured CUDA graphs (buffers generation {self.captured_generation} -> {gen}); "
            f"replaying them would read freed buffers. {self.remedy}"
        )


def _split_target(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    return DEFAULT_SPLIT_TARGET


def _layout_doc(layout: str) -> str:
    if layout == "NHD":
        return "[num_pages, page_size, num_kv_heads, head_dim]"
    return "[num_pages, num_kv_heads, page_size, head_dim]"


_INT64_MAX = np.iinfo(np.int64).max


def _host_int_array(name: str, value: Any, ndim: int, keep_dtype: bool = False) -> np.ndarray:
    """A C-contiguous host copy of an integer tensor/array argument (int32 kept as is, other
    integer types as int64, or as they are with ``keep_dtype``), with its rank checked."""
    if isinstance(value, torch.Tensor):
        if value.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must be an int32 tensor, got {value.dtype}")
        if value.device.type == "meta":
            raise ValueError(f"{name} is a meta tensor (it holds no values)")
        arr = value.detach().to("cpu").numpy()
    elif isinstance(value, np.ndarray):
        if not np.issubdtype(value.dtype, np.integer):
            raise TypeError(f"{name} must be an integer array, got {value.dtype}")
        arr = value
    else:
        raise TypeError(f"{name} must be a torch.Tensor or numpy array, got {type(value).__name__}")
    if arr.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(arr.shape)}")
    if arr.dtype == np.int32 or keep_dtype:
        return np.ascontiguousarray(arr)
    if arr.dtype == np.uint64 and arr.size and arr.max() > _INT64_MAX:
        at = tuple(int(i) for i in np.unravel_index(int(arr.argmax()), arr.shape))
        raise ValueError(f"{name}[{', '.join(map(str, at))}] = {int(arr.max())} is out of range")
    return np.ascontiguousarray(arr, dtype=np.int64)


def _int32_page_ids(
    table: np.ndarray, lens: np.ndarray, indptr: np.ndarray, page_size: int
) -> np.ndarray:
    """``table`` (any integer dtype) as int32, after checking that every entry a request with
    new tokens uses (its first ``ceil(len / page_size)``) is a page id in [0, 2**31); other
    entries may hold anything."""
    if table.dtype == np.int32:
        return table
    int32_max = np.iinfo(np.int32).max
    if table.size == 0 or (int(table.min()) >= 0 and int(table.max()) <= int32_max):
        return table.astype(np.int32)
    bad = _entries_read(table, lens, indptr, page_size) & ((table < 0) | (table > int32_max))
    if bad.any():
        b, j = (int(x) for x in np.argwhere(bad)[0])
        v = int(table[b, j])
        what = "a negative page id" if v < 0 else "a page id beyond int32 range"
        raise IndexError(f"block_table[{b}, {j}] = {v} is {what}")
    return table.astype(np.int32)  # unused entries may wrap: they are never read


def _host_qo_indptr(qo_indptr: Any, b: int) -> np.ndarray:
    """int64 host copy of ``qo_indptr`` [B+1] (None: one new token per request)."""
    if qo_indptr is None:
        return np.arange(b + 1, dtype=np.int64)
    indptr = _host_int_array("qo_indptr", qo_indptr, ndim=1).astype(np.int64, copy=False)
    if indptr.shape[0] != b + 1:
        raise ValueError(f"qo_indptr must have B+1 = {b + 1} entries, got {indptr.shape[0]}")
    return indptr


def _check_scale(scale: Any) -> float:
    if isinstance(scale, bool) or not isinstance(scale, int | float | np.floating | np.integer):
        raise TypeError(f"scale must be a real number, got {type(scale).__name__}")
    value = float(scale)
    if not math.isfinite(value):
        raise ValueError(f"scale must be finite, got {value}")
    return value


def _check_lengths(table: np.ndarray, lens: np.ndarray, indptr: np.ndarray, page_size: int) -> None:
    if (lens < 0).any():
        b = int(np.flatnonzero(lens < 0)[0])
        raise ValueError(f"seq_lens[{b}] = {int(lens[b])} is negative")
    if indptr.shape[0] and indptr[0] != 0:
        raise ValueError(f"qo_indptr must start at 0, got {int(indptr[0])}")
    qo_len = np.diff(indptr)
    if (qo_len < 0).any():
        b = int(np.flatnonzero(qo_len < 0)[0])
        raise ValueError(f"qo_indptr is decreasing at request {b} (negative query length)")
    if (qo_len > lens).any():
        b = int(np.flatnonzero(qo_len > lens)[0])
        raise ValueError(
            f"qo_indptr gives request {b} {int(qo_len[b])} new tokens but seq_lens[{b}] is "
            f"{int(lens[b])}; seq_lens must include the new tokens"
        )
    capacity = table.shape[1] * page_size
    if (lens > capacity).any():
        b = int(np.flatnonzero(lens > capacity)[0])
        raise ValueError(
            f"seq_lens[{b}] = {int(lens[b])} needs {-(-int(lens[b]) // page_size)} pages but "
            f"block_table rows hold {table.shape[1]} (page_size {page_size})"
        )


def _entries_read(
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
        read = _entries_read(table, lens, indptr, page_size)
        b, j = (int(x) for x in np.argwhere(read & (table < 0))[0])
        raise IndexError(f"block_table[{b}, {j}] = {int(table[b, j])} is a negative page id")


def _buffer_sizes(w: int, p: int, s: int, t: int) -> dict[str, int]:
    """Plan buffer sizes for ``w`` items, ``p`` page ids, ``s`` slots and ``t`` tokens."""
    return dict(
        kv_page_indptr=w + 1, kv_pages=p, kv_start=w, kv_len=w, q_indptr=w + 1,
        q_tokens=s, q_limit=s, q_out=s, tile_id=w, merge_tokens=t, merge_indptr=t + 1,
        merge_partials=s, counts=COUNTS_LEN,
    )  # fmt: skip


class _Guard:
    """Device state of hinted plans: the fallback plan's buffers, the buffers of the check's
    inputs, the fallback plan the launches read (the latest one loaded into ``buffers``, so
    its views are of the current buffers), and the kernel variants it may use."""

    def __init__(self, device: torch.device) -> None:
        self.buffers = PlanBuffers(device)
        self.check_buffers = PlanBuffers(device)
        self.plan: LaunchPlan | None = None
        self.variants = 0


def _table_positions(row_of: np.ndarray, width: int, cols: int) -> np.ndarray:
    """int32 [B, cols]: ``row_of[b] * width + column``, the positions in a device table of
    each request's first ``cols`` pages (int32 range checked by ``_device_table_inputs``)."""
    return row_of.astype(np.int32)[:, None] * np.int32(width) + np.arange(cols, dtype=np.int32)


def _item_rows(
    host: PlanArrays, indptr: np.ndarray, row_of: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The table row of each query slot, and of each item's first slot (its page source)."""
    req = np.searchsorted(indptr, host.q_tokens.astype(np.int64), side="right") - 1
    slot_row = row_of[req]
    return slot_row, slot_row[host.q_indptr[:-1]]


def _hint_positions(
    host: PlanArrays, indptr: np.ndarray, row_of: np.ndarray, width: int, page_size: int
) -> np.ndarray:
    """Positions in the device table (row * width + column) of every item's pages: the
    columns of the item's KV run in the row of its first request."""
    kpi = host.kv_page_indptr.astype(np.int64)
    if (host.kv_start % page_size).any():
        raise RuntimeError("prefixattn internal error: a work item starts inside a page")
    _, rep_row = _item_rows(host, indptr, row_of)
    item = np.repeat(np.arange(len(host.kv_len)), np.diff(kpi))
    col = host.kv_start[item].astype(np.int64) // page_size + (np.arange(kpi[-1]) - kpi[item])
    return (rep_row[item] * width + col).astype(np.int32)


def _hint_checks(
    host: PlanArrays, indptr: np.ndarray, row_of: np.ndarray, width: int, page_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Runs of pages to compare on the device: for every item and every request of it other
    than the one its pages are read from, (first position in that request's row, first
    position in the source row, page count)."""
    slot_row, rep_row = _item_rows(host, indptr, row_of)
    slots: np.ndarray = np.diff(host.q_indptr).astype(np.int64)
    item = np.repeat(np.arange(len(host.kv_len)), slots)
    npages = np.diff(host.kv_page_indptr.astype(np.int64))[item]
    keep = (slot_row != rep_row[item]) & (npages > 0)
    col0 = host.kv_start[item].astype(np.int64) // page_size
    a0 = slot_row * width + col0
    b0 = rep_row[item] * width + col0
    return (a0[keep].astype(np.int32), b0[keep].astype(np.int32), npages[keep].astype(np.int32))


_DEVICE_ARRAYS = (
    "kv_page_indptr", "kv_pages", "kv_start", "kv_len", "q_indptr", "q_tokens", "q_limit",
    "q_out", "tile_id", "merge_tokens", "merge_indptr", "merge_partials",
)  # fmt: skip
