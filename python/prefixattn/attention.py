"""The engine-facing API: ``PrefixAttention(...).plan(...)`` once per step, ``.run(...)`` per layer.

:class:`PrefixAttention` ties the stages together: the host planner (:mod:`prefixattn.plan`)
turns a block table into a plan, and the device stage (:mod:`prefixattn.runtime`) loads its
arrays into fixed-address buffers and runs it on the CUDA kernels or the PyTorch reference.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar, cast, overload

import numpy as np
import torch

from . import checks
from .options import LaunchOptions, PlanOptions
from .plan.advance import ADVANCE_STEPS, AdvanceIndex, advance, advances, with_room
from .plan.device_table import (
    hint_checks,
    hint_positions,
    hinted_table,
    item_rows,
    position_runs,
    table_positions,
)
from .plan.layout import LEAF_PAIRS_PER_SM, NUM_VARIANTS, VARIANT_ROWS, variant_mask
from .plan.packing import MIN_SPLIT_TOKENS, PACKINGS, BatchShape
from .plan.planner import HostPlan, build_host_plan
from .plan.tiles import SUPPORTED_HEAD_DIMS, TileTable, tile_table
from .plan.types import LaunchPlan
from .runtime import library
from .runtime.buffers import (
    HintedState,
    PlanBuffers,
    Workspace,
    buffer_sizes,
    load_plan_arrays,
    pages_differ,
)
from .runtime.launch import run_plan
from .runtime.reference import run_plan_reference

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
    max_context_len: int,
    max_requests: int,
    depth_allowance: int = DECODE_DEPTH_ALLOWANCE,
    min_split_tokens: int = MIN_SPLIT_TOKENS,
) -> int:
    """(work item, token) slots one decode token can take in a plan.

    The work items a token joins cut its KV into pieces: one per forest node on its path (up
    to ``depth_allowance``) plus the long-KV split parts. A split part is never shorter than
    ``min_split_tokens`` (``PlanOptions.min_split_tokens``), so a token joins at most
    ``min(ceil(L / min_split_tokens), 2 * B)`` extra parts (B requests make at most 2B - 1
    forest nodes). Plans of leaf chunks alone (small decode batches) are cut at
    ``PlanOptions.leaf_split_tokens`` instead; their extra parts are bounded in all, not per
    token (:func:`leaf_split_spare`).
    """
    parts = min(2 * max_requests, -(-max_context_len // min_split_tokens)) + 1
    return depth_allowance + parts


def leaf_split_spare(num_qo_heads: int, num_kv_heads: int, split_target: int) -> int:
    """(work item, token) slots that a plan of leaf chunks alone (every row chunk of at most
    16 query rows) may take beyond one per chunk, at any split floor: the split rule's
    balance cuts such chunks into at most ``2 x 8 x split_target / num_kv_heads`` parts
    beyond one per chunk in all (8 leaf pairs per SM, ``LEAF_PAIRS_PER_SM``), each with at
    most ``16 / group`` tokens.

    Worked example: 32/8 heads (group 4), 132 SMs -> 264 parts x 4 tokens = 1056 slots.
    """
    group = num_qo_heads // num_kv_heads
    parts = -(-2 * LEAF_PAIRS_PER_SM * split_target // num_kv_heads)
    return parts * max(1, VARIANT_ROWS[0] // group)


def decode_reservation(
    max_requests: int,
    max_tokens: int,
    max_context_len: int,
    page_size: int,
    slots_per_token: int | None = None,
    spare_slots: int = 1024,
) -> dict[str, int]:
    """Sizes for :meth:`PrefixAttention.reserve` that no decode batch of up to
    ``max_requests`` requests and ``max_tokens`` query tokens, each with KV length at most
    ``max_context_len``, outgrows (CUDA-graph capture).

    ``slots_per_token`` defaults to :func:`decode_slots_per_token`; ``spare_slots`` are
    added (at least :func:`leaf_split_spare` of the attention's shape and split target, for
    plans of small batches cut at the leaf floor). Every item holds at least one (item,
    token) slot; the page ids of all items add up to at most one read per request of its
    own pages (the query-centric total) plus one partial page per item.
    """
    if slots_per_token is None:
        slots_per_token = decode_slots_per_token(max_context_len, max_requests)
    slots = max_tokens * slots_per_token + spare_slots
    pages_per_request = -(-max_context_len // page_size) + 1
    return {
        "num_work_items": slots,
        "num_pages": max_requests * pages_per_request + slots,
        "num_slots": slots,
        "num_tokens": max_tokens,
    }


_T = TypeVar("_T")
_F = TypeVar("_F", bound=Callable[..., Any])

_LOADED = "_prefixattn_loaded"
"""Attribute of a plan whose arrays live in a PrefixAttention's fixed-address buffers: (that
object's token, the generation of its main buffers the plan was loaded as, and that of the
fallback buffers for a hinted plan, else None). Not a dataclass field, so a copy made with
``dataclasses.replace`` carries no check."""


def _serialized(method: _F) -> _F:
    """Run ``method`` under the object's plan lock where plans share its device buffers."""

    @functools.wraps(method)
    def wrapper(self: PrefixAttention, *args: Any, **kwargs: Any) -> Any:
        with self._plan_guard():
            return method(self, *args, **kwargs)

    return cast(_F, wrapper)


class _Option(Generic[_T]):
    """An attribute of :class:`PrefixAttention` that reads and writes (validated) one field
    of its ``plan_options`` or ``launch_options``."""

    def __init__(self, group: str, cls: type) -> None:
        self.group = group
        self.cls = cls
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name
        self.__doc__ = f"``{self.group}.{name}`` (see :class:`{self.cls.__name__}`)."

    @overload
    def __get__(self, obj: None, owner: type) -> _Option[_T]: ...
    @overload
    def __get__(self, obj: object, owner: type) -> _T: ...
    def __get__(self, obj: object | None, owner: type) -> _Option[_T] | _T:
        if obj is None:
            return self
        value: _T = getattr(getattr(obj, self.group), self.name)
        return value

    def __set__(self, obj: object, value: _T) -> None:
        setattr(getattr(obj, self.group), self.name, value)


class PrefixAttention:
    """Prefix-aware paged attention for one model's attention shape.

    Build one per model (or per attention shape) and keep it: it owns the plan's device buffers.
    Each step, call :meth:`plan` once with the batch's block table and lengths; then call
    :meth:`run` in every layer with that layer's query and KV cache.

    Threads: a plan is a host object, but on a CUDA device its index arrays live in this
    object's fixed-address buffers (CUDA graphs replay them), which every ``plan*`` call
    overwrites. So:

    - :meth:`run` without ``plan=`` runs the calling thread's last plan (:attr:`last_plan`
      is per thread); another thread's plans never replace it.
    - On a CUDA device a plan stays valid only until the next ``plan*`` call on the same
      object, from any thread (for a hinted plan, also :meth:`reserve` with ``hinted``):
      :meth:`run` raises ``RuntimeError`` ("stale plan") for an older one instead of
      reading the newer plan's arrays. ``plan*`` calls are serialized
      by a lock, but the caller orders each thread's ``plan`` -> ``run`` sequence against
      the others' (or uses one object per thread); the partials scratch is shared too, so
      runs on several streams at once need one object each.
    - On the CPU each plan owns its arrays: plans from any thread stay valid, and planning
      runs in parallel.

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
        as long as the last dimension is contiguous, except where ``page_size ==
        num_kv_heads > 1``: the shapes of the two layouts are then the same, and ``run``
        reads the layout from the strides of dims 1 and 2. It raises ``ValueError`` for a
        cache whose dim 2 encloses dim 1 in memory (stride(2) >= stride(1) * page_size:
        the other layout's order, e.g. an HND view of an NHD cache passed to an NHD
        object); a contiguous cache (dim 1 enclosing dim 2) is taken as the declared layout,
        since nothing tells a contiguous HND cache from an NHD one there.
    device:
        Where plans put their index arrays (default: CPU).
    dtype:
        Element type of q and the caches; it sets the byte accounting and the packer's cost
        model, and ``run`` checks it.
    plan_options, launch_options:
        The tuning knobs (:class:`~prefixattn.PlanOptions`, :class:`~prefixattn.LaunchOptions`;
        default: their defaults). Each knob is also an attribute of this object
        (``split_target``, ``chain_launches``, ...) that reads and writes the options, checked
        when set.
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
        plan_options: PlanOptions | None = None,
        launch_options: LaunchOptions | None = None,
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
        for name, opts, cls in (
            ("plan_options", plan_options, PlanOptions),
            ("launch_options", launch_options, LaunchOptions),
        ):
            if opts is not None and not isinstance(opts, cls):
                raise TypeError(f"{name} must be a {cls.__name__}, got {type(opts).__name__}")
        self.num_qo_heads = num_qo_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.page_size = page_size
        self.kv_layout = kv_layout
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"device {self.device} requested but CUDA is not available")
        self.dtype = dtype
        self.plan_options = PlanOptions() if plan_options is None else plan_options
        """How plans are built (host work); see :class:`PlanOptions`."""
        self.launch_options = LaunchOptions() if launch_options is None else launch_options
        """How ``run`` launches plans; see :class:`LaunchOptions`."""
        self.tiles = tile_table(head_dim)
        self._shape = BatchShape(
            num_qo_heads, num_kv_heads, head_dim, torch.empty(0, dtype=dtype).element_size()
        )
        self._local = threading.local()  # .plan: the calling thread's last plan
        # The last planning tables of device-table plans and what they were made from
        # (_positions_table, _hinted_table): a decode run plans from the same ones each step.
        self._table_memo: dict[str, tuple[tuple[Any, ...], np.ndarray]] = {}
        # The last host plan of each kind of device-table plan and its inputs, which the next
        # decode step's plan advances (plan.advance) instead of planning afresh.
        self._advance_memo: dict[tuple[Any, ...], _Advanceable] = {}
        # The hint checks of the last hinted plan's lineage (plan_hinted).
        self._check_memo: tuple[tuple[Any, ...], dict[str, np.ndarray]] | None = None
        self._plan_lock = threading.RLock()
        self._generation = 0
        """Plans loaded into the main buffers so far (CUDA): a plan of another generation
        was overwritten."""
        self._fallback_generation = 0  # the same for the hinted plans' fallback buffers
        self._token = object()
        self._buffers: PlanBuffers | None = None
        self._workspace: Workspace | None = None
        self._hinted: HintedState | None = None
        self._fixed_table: TileTable | None = None
        """The tile table of this object's first fixed-grid run (a CUDA graph capture, or
        ``fixed_grid``): such runs launch the kernel variants of its heights for their
        token count (:meth:`_fixed_launches`), and every plan from then on must keep within
        them (:meth:`_launch_plan` checks)."""

    # The knobs of both option groups, as attributes (validated when set).
    native_plan = _Option[bool]("plan_options", PlanOptions)
    split_target = _Option[int | None]("plan_options", PlanOptions)
    pack_heads = _Option[bool]("plan_options", PlanOptions)
    finish_in_leaf = _Option[bool]("plan_options", PlanOptions)
    one_launch_in_one_wave = _Option[bool]("plan_options", PlanOptions)
    split_waves = _Option[bool]("plan_options", PlanOptions)
    min_split_tokens = _Option[int]("plan_options", PlanOptions)
    leaf_split_tokens = _Option[int]("plan_options", PlanOptions)
    max_plan_bytes = _Option[int | None]("plan_options", PlanOptions)
    use_kernels = _Option[bool]("launch_options", LaunchOptions)
    prefetch_tiles = _Option[int]("launch_options", LaunchOptions)
    fixed_grid = _Option[bool]("launch_options", LaunchOptions)
    concurrent_groups = _Option[bool]("launch_options", LaunchOptions)
    chain_launches = _Option[bool]("launch_options", LaunchOptions)

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
        return main + (0 if self._hinted is None else self._hinted.buffers.generation)

    @property
    def tiles(self) -> TileTable:
        """The tile table plans choose (m, n) tiles from (``prefixattn.plan.tiles``); a
        :class:`~prefixattn.plan.tiles.TileTable`, checked when it is made."""
        return self._tiles

    @tiles.setter
    def tiles(self, table: TileTable) -> None:
        if not isinstance(table, TileTable):
            raise TypeError(f"tiles must be a TileTable, got {type(table).__name__}")
        self._tiles = table

    @property
    def last_plan(self) -> LaunchPlan | None:
        """The plan :meth:`run` uses by default: the last one a ``plan*`` call of the calling
        thread built (None before)."""
        plan: LaunchPlan | None = getattr(self._local, "plan", None)
        return plan

    @_serialized
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
        sizes = buffer_sizes(num_work_items, num_pages, num_slots, num_tokens)
        self._main_buffers().reserve(**sizes)
        if hinted:
            state = self._enable_hinted()
            state.fixed = True  # graphs captured from now on launch its variants
            state.buffers.reserve(**sizes)
            # Reload the empty fallback: the graphs captured next must read the reserved
            # buffers, not the ones they replaced.
            state.plan = self._empty_fallback(state)
        # Every partial row is one (item, token) slot, so slots bound the partials.
        self._reserve_workspace(num_slots)

    # ------------------------------------------------------------------ plan
    @_serialized
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
        checks.check_split_kv(split_kv)
        table, lens, indptr = checks.plan_inputs(
            block_table, seq_lens, qo_indptr, packing, PACKINGS
        )
        checks.check_lengths(table, lens, indptr, self.page_size)
        table = checks.int32_page_ids(table, lens, indptr, self.page_size)
        plan = self._plan_host(table, lens, indptr, packing, split_kv)
        self._quiet_fallback()
        return plan

    @_serialized
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
        checks.check_split_kv(split_kv)
        lens, indptr, row_of, cols = checks.device_table_inputs(
            block_table, seq_lens, qo_indptr, rows, self.device, self.page_size
        )
        # Positions as page ids: rows never share one, so the forest has no sharing.
        positions = self._positions_table(row_of, block_table.shape[1], cols)
        checks.check_lengths(positions, lens, indptr, self.page_size)
        plan = self._plan_host(
            positions, lens, indptr, "per_query", split_kv, page_table=block_table, row_of=row_of
        )
        self._quiet_fallback()
        return plan

    @_serialized
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
        """A prefix-aware plan whose forest comes from a host ``hint`` of the block table (for
        example the previous step's copy), so it never waits for the GPU.

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
            As in :meth:`plan_unshared`. Decode steps (one new token per request) and steps
            with prefill chunks alike; requests whose rows the hint lacks (new requests) are
            planned as sharing nothing.
        private:
            Host bool array [B]: requests whose pages the hint does not describe (e.g. an
            engine's padding requests, which read some real row): planned as sharing nothing.

        On a CUDA device the first call sets up the fallback's buffers (see :meth:`reserve`,
        ``hinted``); from then on every :meth:`run` also launches the fallback plan, which is
        empty unless a hinted plan's check failed. The fallback launches the tile heights its
        plans have needed so far; after ``reserve(hinted=True)`` (CUDA graphs captured over
        them) they are those of decode steps, and a step with several new tokens for a
        request raises ``ValueError``.
        """
        lens, indptr, row_of, cols = checks.device_table_inputs(
            block_table, seq_lens, qo_indptr, rows, self.device, self.page_size
        )
        hint_arr = checks.host_int_array("hint", hint, ndim=2)
        width, ps = block_table.shape[1], self.page_size
        if isinstance(private, torch.Tensor):
            private = private.cpu()
        table = self._hinted_table(hint_arr, row_of, width, cols, private)
        checks.check_lengths(table, lens, indptr, ps)
        positions = self._positions_table(row_of, width, cols)
        state = self._enable_hinted() if self.device.type == "cuda" else None
        q_lens = np.diff(indptr)
        if state is not None and state.fixed and (q_lens > 1).any():
            r = int(np.flatnonzero(q_lens > 1)[0])
            raise ValueError(
                "plan_hinted: this object's fallback launches were fixed for decode steps by "
                f"reserve(hinted=True) (CUDA graphs), but request {r} has {int(q_lens[r])} new "
                "tokens; plan this step on another PrefixAttention, or with plan() or "
                "plan_unshared()"
            )
        fallback = self._plan_host(
            positions, lens, indptr, "per_query", False, page_table=block_table, row_of=row_of,
            buffers=None if state is None else state.buffers, remember=False, one_table=True,
        )  # fmt: skip
        if state is not None:
            # From now on the launches read the fallback through views of the buffers as they
            # are now (they may have grown for this plan).
            state.plan = fallback
            used = variant_mask({m for m, _ in fallback.tiles})
            if fallback.num_merge_tokens:
                raise RuntimeError(
                    f"prefixattn internal error: the fallback plan has "
                    f"{fallback.num_merge_tokens} merges, outside its launches"
                )
            if used & ~state.variants:
                if state.fixed:
                    raise RuntimeError(
                        f"prefixattn internal error: the fallback plan uses tiles "
                        f"{fallback.tiles}, outside its fixed launches"
                    )
                state.variants |= used  # later runs launch these too (no graph captured them)
        primary = self._plan_host(
            table, lens, indptr, "memory", True, page_table=block_table, row_of=row_of,
        )  # fmt: skip
        # The checks look at shared items only, which advancing a plan leaves as they were.
        check_key = (primary.lineage, indptr.tobytes(), row_of.tobytes(), width)
        if self._check_memo is not None and self._check_memo[0] == check_key:
            runs = self._check_memo[1]
        else:
            runs = hint_checks(primary.host, indptr, row_of, width, ps)
            self._check_memo = (check_key, runs)
        taken = pages_differ(block_table, runs, state, self.device)
        primary.counts.mul_((~taken).to(torch.int32))
        fallback.counts.mul_(taken.to(torch.int32))
        plan = dataclasses.replace(primary, fallback=fallback, fallback_taken=taken)
        if hasattr(primary, _LOADED):  # its fallback was loaded just before it
            loaded = (self._token, self._generation, self._fallback_generation)
            object.__setattr__(plan, _LOADED, loaded)
        self._local.plan = plan
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
            The plan to run (default: :attr:`last_plan`, the last one a ``plan*`` call of
            the calling thread built). On a CUDA device only the object's latest plan can
            run: an older one raises ``RuntimeError`` (its arrays were overwritten; see the
            class docstring).

        Where ``page_size == num_kv_heads`` the shapes of NHD and HND caches are the same:
        caches whose strides put them in the other layout's order raise ``ValueError``, and
        contiguous ones are read in ``kv_layout`` (see the constructor's ``kv_layout``).

        Returns ``out`` (or a new tensor). CUDA tensors run on the CUDA kernels (no host sync,
        no allocation once the scratch is reserved; capturable in a CUDA graph, see
        :attr:`cuda_graph_safe`); where the kernels cannot run them (no compiled kernels for
        this GPU, or a dtype other than float16/bfloat16) ``run`` raises ``RuntimeError`` with
        the reason, unless ``launch_options.use_kernels`` is False: that explicit opt-in runs
        the slow PyTorch reference on CUDA tensors. CPU tensors always run on the reference
        (``prefixattn.runtime.reference.run_plan_reference``), which executes the same plan.
        """
        plan = self._plan_to_run(plan)
        geometry = (self.num_qo_heads, self.num_kv_heads, self.head_dim, self.page_size,
                    self.kv_layout)  # fmt: skip
        checks.check_run_inputs(geometry, self.dtype, plan, q, k_cache, v_cache, out)
        scale = 1.0 / math.sqrt(self.head_dim) if scale is None else checks.check_scale(scale)
        if out is None:
            out = torch.empty_like(q)
        launch = self.launch_options
        if q.is_cuda and launch.use_kernels:
            _require_kernels(q.dtype)
            if self._workspace is None:
                self._workspace = Workspace(q.device, q.dtype)
            finish = self.plan_options.finish_in_leaf
            # A fixed grid (graph capture) launches only the variants a plan of this many
            # tokens can use, not all of them: fewer empty launches in small batches' graphs.
            fixed = launch.fixed_grid or torch.cuda.is_current_stream_capturing()
            variants = self._fixed_launches(q.shape[0]) if fixed else -1
            run_plan(plan, q, k_cache, v_cache, out, scale, self._workspace, launch,
                     finish=finish, fixed_variants=variants)  # fmt: skip
            if self._hinted is not None:
                # The fallback of hinted plans: its counts are zero unless a check failed
                # (then the plan above did nothing).
                fallback = plan.fallback or self._hinted.plan
                assert fallback is not None
                run_plan(
                    fallback, q, k_cache, v_cache, out, scale, self._workspace, launch,
                    finish=finish, fixed_variants=self._hinted.variants, host_counts=False,
                )  # fmt: skip
            return out
        if plan.fallback is not None and plan.fallback_taken is not None and plan.fallback_taken:
            plan = plan.fallback  # the hint's check failed
        return run_plan_reference(plan, q, k_cache, v_cache, out, scale)

    # ------------------------------------------------------------- internals
    @property
    def _plans_share_buffers(self) -> bool:
        """Plans load their arrays into this object's fixed-address buffers (CUDA), which
        the next plan overwrites."""
        return self.device.type == "cuda"

    def _plan_guard(self) -> contextlib.AbstractContextManager[Any]:
        """The lock of ``plan*`` calls where plans share buffers (host planning in parallel
        otherwise)."""
        return self._plan_lock if self._plans_share_buffers else contextlib.nullcontext()

    def _plan_to_run(self, plan: LaunchPlan | None) -> LaunchPlan:
        """``plan``, or the calling thread's last one, after checking that its arrays were
        not overwritten by a later plan."""
        if plan is None:
            plan = self.last_plan
            if plan is None:
                raise RuntimeError(
                    "PrefixAttention.run called before plan() in this thread (run uses the "
                    "calling thread's last plan by default; pass plan= to run another)"
                )
        loaded = getattr(plan, _LOADED, None)
        if loaded is None or loaded[0] is not self._token:
            return plan
        if loaded[1] != self._generation:
            why = f"a later plan (#{self._generation}, by this or another thread)"
        elif loaded[2] not in (None, self._fallback_generation):
            why = "reserve(hinted=True) (its fallback's arrays)"
        else:
            return plan
        raise RuntimeError(
            f"prefixattn: stale plan: the device arrays of plan #{loaded[1]} of this "
            f"PrefixAttention were overwritten by {why}; a plan stays valid only until the "
            "next plan*() call on the same object. Plan again, or use one PrefixAttention "
            "per thread"
        )

    def _main_buffers(self) -> PlanBuffers:
        if self._buffers is None:
            self._buffers = PlanBuffers(self.device)
        return self._buffers

    def _enable_hinted(self) -> HintedState:
        """The fallback state of hinted plans (created once, with an empty fallback plan)."""
        if self._hinted is not None:
            return self._hinted
        state = HintedState(self.device)
        self._hinted = state
        state.plan = self._empty_fallback(state)
        # A decode step's fallback plan (one token per request, no split) uses the tile height
        # of one token's rows and no merge; steps with more tokens add heights (plan_hinted).
        height = self.tiles.select(self.num_qo_heads // self.num_kv_heads, 1)[0]
        state.variants = variant_mask({height})
        return state

    def _empty_fallback(self, state: HintedState) -> LaunchPlan:
        """A fallback plan with zero counts, loaded into the hinted state's buffers."""
        one = np.ones(1, np.int64)
        plan = self._plan_host(
            np.zeros((1, 1), np.int32), one, np.arange(2, dtype=np.int64), "per_query", False,
            buffers=state.buffers, remember=False,
        )  # fmt: skip
        plan.counts.zero_()
        return plan

    def _quiet_fallback(self) -> None:
        """A plan that is not hinted was loaded: the fallback launches must do nothing."""
        if self._hinted is not None and self._hinted.plan is not None:
            self._hinted.plan.counts.zero_()

    def _reserve_workspace(self, num_partials: int) -> None:
        if self._workspace is None:
            self._workspace = Workspace(self.device, self.dtype)
        if self._workspace.reserve(num_partials, self.num_qo_heads, self.head_dim, self.dtype):
            self._main_buffers().generation += 1

    # Planning tables are made this many columns wider than needed, so that the steps of a
    # decode run (one more token per request each) plan from the same table.
    _TABLE_COLUMN_STEP = 64

    def _table_columns(self, width: int, cols: int) -> int:
        return min(width, -(-cols // self._TABLE_COLUMN_STEP) * self._TABLE_COLUMN_STEP)

    def _positions_table(self, row_of: np.ndarray, width: int, cols: int) -> np.ndarray:
        """:func:`table_positions`, at least ``cols`` columns; the last one again where the rows
        are the same and it is wide enough (a plan reads only each request's pages)."""
        key = (row_of.tobytes(), width)
        memo = self._table_memo.get("positions")
        if memo is not None and memo[0] == key and memo[1].shape[1] >= cols:
            return memo[1]
        table = table_positions(row_of, width, self._table_columns(width, cols))
        self._table_memo["positions"] = (key, table)
        return table

    def _hinted_table(
        self, hint: np.ndarray, row_of: np.ndarray, width: int, cols: int, private: Any
    ) -> np.ndarray:
        """:func:`hinted_table`, at least ``cols`` columns; the last one again for the same
        read-only hint array (``TableHint`` makes its copies read-only), rows and private
        requests, where it is wide enough."""
        mask = None if private is None else np.asarray(private)
        key = (row_of.tobytes(), None if mask is None else mask.tobytes())
        memo = self._table_memo.get("hinted")
        if (
            memo is not None
            and not hint.flags.writeable
            and memo[0][0] is hint
            and memo[0][1:] == key
            and memo[1].shape[1] >= cols
        ):
            return memo[1]
        wide = self._table_columns(width, cols)
        try:
            table = hinted_table(hint, row_of, wide, private)
        except ValueError:  # the unknown pages' ids would pass int32 at the wider table
            if wide == cols:
                raise
            table = hinted_table(hint, row_of, cols, private)
        self._table_memo["hinted"] = ((hint, *key), table)
        return table

    def _plan_host(
        self,
        table: np.ndarray,
        lens: np.ndarray,
        indptr: np.ndarray,
        packing: str,
        split_kv: bool,
        page_table: torch.Tensor | None = None,
        *,
        row_of: np.ndarray | None = None,
        buffers: PlanBuffers | None = None,
        remember: bool = True,
        one_table: bool = False,
    ) -> LaunchPlan:
        """The plan of checked host inputs. With ``page_table`` (and ``row_of``, the row of
        it each request reads), the pages are positions in it (row * width + column), each
        item's from the row of its first request, and the device replaces them by the table's
        entries: expanded from runs on the device where the items allow
        (:func:`position_runs`), else copied. ``buffers``: where the arrays go on a CUDA device
        (default: this object's); ``remember``: make it the plan :meth:`run` uses by
        default. ``one_table``: one build, on the tile table's narrow alternative where it
        has one (a hinted plan's fallback, which runs only where the device check fails:
        its tiles are not worth a second build)."""
        options = self.plan_options
        if options.split_target is None:
            options.split_target = sm_count(self.device)
        tiles = (self.tiles.narrow() or self.tiles) if one_table else self.tiles
        hp = None
        if page_table is not None:
            assert row_of is not None
            # The options' values (all scalars) as they are now: a cheap key.
            key = (packing, split_kv, buffers is None, tuple(vars(options).values()), tiles)
            hp = self._advanced(key, table, lens, indptr, row_of)
        if hp is None:
            native = options.native_plan and library.native_plan_available()
            hp = build_host_plan(
                table, lens, indptr, self.page_size, self._shape, tiles, packing, split_kv,
                split_target=options.split_target, sm_count=sm_count(self.device),
                native=native, finish_in_leaf=options.finish_in_leaf,
                one_launch_in_one_wave=options.one_launch_in_one_wave,
                pack_heads=options.pack_heads, max_bytes=options.max_plan_bytes,
                page_ids=page_table is None, split_waves=options.split_waves,
                min_split_tokens=options.min_split_tokens,
                leaf_split_tokens=options.leaf_split_tokens,
            )  # fmt: skip
            if page_table is not None:
                assert row_of is not None
                if advances(indptr):
                    # Room to advance; a plan that never advances keeps its pages end to end.
                    room = self._page_room(buffers, len(hp.host.kv_pages))
                    hp = with_room(hp, self.page_size, room)
                self._advance_memo[key] = _Advanceable(
                    table, row_of.copy(), indptr.copy(), lens.copy(), hp, 0
                )
        arrays = hp.device_arrays()
        runs = None
        if page_table is not None:
            assert row_of is not None
            width, ps = page_table.shape[1], self.page_size
            # The runs stay the same while the advanced plans' pages do not move.
            kept = self._advance_memo[key].kept
            layout = (hp.host.kv_page_offset, len(hp.host.kv_pages), width)
            last_runs = kept.get("runs")
            if (
                last_runs is not None
                and last_runs[0][0] is layout[0]
                and last_runs[0][1:] == layout[1:]
            ):
                runs = last_runs[1]
            else:
                runs = position_runs(hp.host, item_rows(hp.host, indptr, row_of)[1], width, ps)
                kept["runs"] = (layout, runs)
            if runs is None:
                arrays["kv_pages"] = hint_positions(hp.host, indptr, row_of, width, ps)
        generation = None
        if self._plans_share_buffers:
            # Counted before the load: from here on the buffers no longer hold the last plan.
            if buffers is None:
                self._generation += 1
                generation = self._generation
            else:
                self._fallback_generation += 1
        views = load_plan_arrays(
            arrays,
            self.device,
            lambda: buffers if buffers is not None else self._main_buffers(),
            page_table,
            runs,
        )
        if self.device.type == "cuda":
            # The partials scratch grows here, on the host side of the step, so that
            # buffers_generation tells graph users about it before any replay.
            self._reserve_workspace(hp.num_partials)
        plan = self._launch_plan(hp, packing, split_kv, table.shape[0], views, page_table)
        if generation is not None:
            object.__setattr__(plan, _LOADED, (self._token, generation, None))
        if remember:
            self._local.plan = plan
        return plan

    def _page_room(self, buffers: PlanBuffers | None, pages: int) -> int | None:
        """Page entries a device-table plan of ``pages`` may take with room to advance
        (:func:`with_room`): what its CUDA buffers hold where they hold that many already
        (so that the room never moves a reserved buffer), else no limit."""
        if self.device.type != "cuda":
            return None
        have = (buffers if buffers is not None else self._main_buffers()).capacity("kv_pages")
        return have if have >= pages else None

    def _fixed_launches(self, num_tokens: int) -> int:
        """The launches of a fixed-grid run of ``num_tokens`` query tokens: the kernel
        variants of the heights any plan of at most that many tokens may use
        (``TileTable.heights_up_to``) and the merge (bit ``NUM_VARIANTS``)."""
        if self._fixed_table is None:
            self._fixed_table = self.tiles
        rows = num_tokens * (self.num_qo_heads // self.num_kv_heads)
        return variant_mask(self._fixed_table.heights_up_to(rows)) | (1 << NUM_VARIANTS)

    def _check_fixed_heights(self, hp: HostPlan) -> None:
        """A plan's tile heights are among those that fixed-grid runs of its token count
        launch (:meth:`_fixed_launches`): the table's own rule, checked on every plan, since
        a graph replaying a plan with another height would skip its items."""
        table = self._fixed_table or self.tiles
        group = self.num_qo_heads // self.num_kv_heads
        allowed = table.heights_up_to(hp.num_tokens * group)
        used = sorted({m for m, _ in hp.tiles})
        if not set(used) <= set(allowed):
            changed = table is not self.tiles
            raise RuntimeError(
                f"prefixattn: a plan of {hp.num_tokens} tokens uses tile heights {used}, but "
                f"fixed-grid launches (CUDA graphs) of that many tokens run only {list(allowed)}"
                + (
                    "; `tiles` changed after a fixed-grid run or graph capture, which is not "
                    "supported: make a new PrefixAttention for the new table"
                    if changed
                    else " (prefixattn internal error)"
                )
            )

    def _advanced(
        self,
        key: tuple[Any, ...],
        table: np.ndarray,
        lens: np.ndarray,
        indptr: np.ndarray,
        row_of: np.ndarray,
    ) -> HostPlan | None:
        """The last device-table plan of this ``key`` advanced to ``lens`` (a decode step
        of the same batch, from the same planning ``table``), else None."""
        last = self._advance_memo.get(key)
        if (
            last is None
            or last.table is not table
            or last.steps >= ADVANCE_STEPS
            or len(last.lens) != len(lens)
            or not np.array_equal(last.indptr, indptr)
            or not np.array_equal(last.row_of, row_of)
        ):
            return None
        index = last.kept.get("index")
        if index is None:
            index = last.kept["index"] = AdvanceIndex(last.plan, indptr, len(lens))
        hp = advance(
            last.plan, last.lens, lens, indptr, self.page_size, self._shape.kv_bytes(1), index
        )
        if hp is not None:
            self._advance_memo[key] = dataclasses.replace(
                last, lens=lens.copy(), plan=hp, steps=last.steps + 1
            )
        return hp

    def _launch_plan(
        self,
        hp: HostPlan,
        packing: str,
        split_kv: bool,
        batch_size: int,
        views: dict[str, torch.Tensor],
        page_table: torch.Tensor | None,
    ) -> LaunchPlan:
        self._check_fixed_heights(hp)
        device_arrays: dict[str, Any] = {n: views[n] for n in hp.device_arrays()}
        return LaunchPlan(
            num_qo_heads=self.num_qo_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            page_size=self.page_size,
            kv_layout=self.kv_layout,
            packing=packing,
            split_kv=split_kv,
            batch_size=batch_size,
            num_tokens=hp.num_tokens,
            num_work_items=len(hp.host.kv_len),
            num_partials=hp.num_partials,
            num_merge_tokens=len(hp.host.merge_tokens),
            # Page ids read from a device table are not known on the host.
            max_page_id=-1 if page_table is not None else hp.max_page_id,
            tiles=hp.tiles,
            tile_indptr=hp.tile_indptr,
            num_ctas=len(hp.host.kv_len) * self.num_kv_heads,
            kv_bytes=hp.kv_bytes,
            partial_bytes=hp.partial_bytes,
            distinct_kv_bytes=hp.distinct_kv_bytes,
            query_centric_kv_bytes=hp.query_centric_kv_bytes,
            qo_bytes=hp.qo_bytes,
            device=self.device,
            **device_arrays,
            host=hp.host,
            forest=hp.forest,
            num_finished=hp.num_finished,
            leaf_max_rows=hp.leaf_max_rows,
            leaf_tiles=hp.leaf_tiles,
            narrow=hp.narrow,
            lineage=hp.lineage,
        )


@dataclasses.dataclass(frozen=True)
class _Advanceable:
    """A device-table host plan and the inputs it was planned (or advanced) for."""

    table: np.ndarray
    row_of: np.ndarray
    indptr: np.ndarray
    lens: np.ndarray
    plan: HostPlan
    steps: int
    """Advances since it was planned afresh."""
    kept: dict[str, Any] = dataclasses.field(default_factory=dict)
    """What stays valid along the plan's advances: its :class:`AdvanceIndex` and the last
    position runs of its pages with their layout."""


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


def sm_count(device: torch.device) -> int:
    """SMs of ``device`` (``DEFAULT_SPLIT_TARGET`` for a CPU device)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    return DEFAULT_SPLIT_TARGET


def _require_kernels(dtype: torch.dtype) -> None:
    """CUDA tensors run on the kernels or not at all (no silent slow path)."""
    opt_in = (
        "(to run the slow PyTorch reference on CUDA tensors instead, set "
        "launch_options.use_kernels = False)"
    )
    if dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError(
            f"prefixattn: the CUDA kernels take float16 or bfloat16, not {dtype} {opt_in}"
        )
    status = library.kernels_status()
    if status != "available":
        raise RuntimeError(f"prefixattn: CUDA kernels {status} {opt_in}")
