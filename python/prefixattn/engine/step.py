"""The per-step planning policy every engine adapter shares.

An engine adapter translates its engine's batch metadata into calls of :class:`StepPlanner`;
the planner decides how the step is planned and keeps the state that decision needs:

- **Which plan method.** :meth:`PrefixAttention.plan_unshared` while the latest batch looked
  at shared no page (no host copy of the block table, so no wait for the GPU);
  :meth:`PrefixAttention.plan_hinted` for steps with sharing (decode steps, and steps with
  prefill chunks that are not replayed from graphs), from an earlier step's host copy of the
  table (:class:`TableHint`, checked on the device); otherwise
  :meth:`PrefixAttention.plan` from a host copy of this step's table, which also updates the
  :class:`SharingProbe` verdict and the hint. Each choice is correct for any batch; the state
  only decides how fast the step is planned.
- **Padding.** Requests past ``num_real`` are the engine's padding (CUDA-graph batches): the
  probe and the hint look at the real requests only.
- **Which batches teach.** Not CUDA-graph capture batches, and not batches of new
  requests' prefills alone (SGLang's extend batches) once a batch of running requests has
  taught: they would have the next decode step planned from new requests' rows and sharing
  (:meth:`StepPlanner.teaches`).
- **Graph and eager objects.** Steps that may be replayed from a captured CUDA graph are
  planned by :attr:`StepPlanner.graph_attention`, whose buffers are reserved before capture
  (:meth:`StepPlanner.reserve_graphs`) and guarded by :attr:`StepPlanner.captured`; every
  other step by :attr:`StepPlanner.eager_attention`, so its plans never move those buffers.
- **Capability probes.** :func:`cuda_graphs_available` and :func:`kernels_unavailable_reason`.

:class:`StepOptions` holds the switches. Defaults: both fast paths on, the graph reservation
of :func:`~prefixattn.decode_reservation`. An adapter takes them from its engine's own
configuration where it has one (vLLM: ``additional_config={"prefixattn": {...}}``) or as a
constructor argument; otherwise from the process-wide defaults set by :func:`configure`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, ClassVar, Literal

import numpy as np
import numpy.typing as npt
import torch
from torch.profiler import record_function

from ..attention import (
    CapturedBuffers,
    PrefixAttention,
    decode_reservation,
    decode_slots_per_token,
    leaf_split_spare,
    sm_count,
)
from ..options import (
    DEFAULT_MIN_SPLIT_TOKENS,
    LAUNCH_OPTIONS,
    PLAN_OPTIONS,
    LaunchOptions,
    PlanOptions,
)
from ..plan.types import LaunchPlan
from ..runtime import library
from .sharing import SharingProbe, TableHint

__all__ = [
    "StepChoice",
    "StepOptions",
    "StepPlanner",
    "configure",
    "cuda_graphs_available",
    "default_options",
    "kernels_unavailable_reason",
]

StepKind = Literal["copy", "unshared", "hinted", "delegated"]

logger = logging.getLogger("prefixattn")


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"StepOptions.{name} must be a bool, got {value!r}")


def _check_slots(name: str, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"StepOptions.{name} must be None or an int, got {value!r}")
    if not 1 <= value <= 2**20:
        raise ValueError(f"StepOptions.{name} must be in [1, {2**20}], got {value}")


def _check_core(name: str, value: Any) -> None:
    if not isinstance(value, Mapping):
        raise TypeError(
            f"StepOptions.{name} must be a mapping of PlanOptions / LaunchOptions fields, "
            f"got {value!r}"
        )
    plan, launch = PlanOptions(), LaunchOptions()
    for key, v in value.items():
        if key in PLAN_OPTIONS:
            setattr(plan, key, v)  # checked there: a wrong value raises with its reason
        elif key in LAUNCH_OPTIONS:
            setattr(launch, key, v)
        else:
            raise AttributeError(
                f"StepOptions.{name}: {key!r} is no PlanOptions or LaunchOptions field; fields: "
                + ", ".join(PLAN_OPTIONS + LAUNCH_OPTIONS)
            )


@dataclasses.dataclass(eq=True, repr=True)
class StepOptions:
    """How :class:`StepPlanner` plans steps; every field is checked when it is set."""

    unshared_plans: bool = True
    """Plan steps with :meth:`PrefixAttention.plan_unshared` while the latest batch looked at
    shared no page. False: such steps copy the block table to the host (:meth:`plan`)."""

    hinted_plans: bool = True
    """Plan steps with sharing with :meth:`PrefixAttention.plan_hinted` from an earlier step's
    host copy of the table (decode steps, and eager steps with prefill chunks, whose new
    requests the hint does not know: planned as sharing nothing). False: they copy this
    step's table (:meth:`plan`)."""

    delegate_unshared: bool = False
    """Run steps that the probe expects to share no page, and that are not replayed from a
    captured CUDA graph, on the engine's own attention kernel where the adapter has one (vLLM:
    ``FLASH_ATTN``'s, SGLang: ``flashinfer``'s): without sharing, prefixattn reads what they
    read, and long private prefills run fastest on the engine's dense prefill kernel. The
    step still teaches the probe and the hint. False (the default until checked in the
    engines on a GPU): such steps are planned unshared. Correct either way; the probe only
    decides the speed."""

    delegate_prefills: bool = False
    """Run new requests' prefill chunks on the engine's own kernel where the adapter has one:
    in vLLM the prefill and extend chunks of an eager step (prefixattn plans the decodes
    beside them), in SGLang an extend batch of new requests alone once a hint exists (a
    hinted plan knows none of its requests and plans each as private). A chunk's queries
    are many per page read, so reading a shared prefix once gains little there, and the
    engine's dense prefill kernel is its fastest. False (the default until checked in the
    engines on a GPU): prefixattn plans them."""

    graph_slots_per_token: int | None = None
    """(work item, token) slots reserved per token of the largest CUDA-graph batch; None: the
    core's :func:`~prefixattn.decode_slots_per_token` for the engine's context length."""

    count_fallbacks: bool = False
    """Diagnostics: count the hinted steps whose device check failed (the step ran the
    per-request fallback) and log :meth:`StepPlanner.counts` every :data:`COUNT_LOG_STEPS`
    planned steps (logger ``prefixattn``, level WARNING, so engines that configure no logging
    show it too). Costs one device add per hinted step and one read of the count (a wait for
    the GPU) per log line; off by default."""

    core_options: Mapping[str, Any] = dataclasses.field(
        default_factory=lambda: MappingProxyType({})
    )
    """Kernel-side options of the cores the planner creates: names and values of
    :class:`~prefixattn.PlanOptions` and :class:`~prefixattn.LaunchOptions` fields, e.g.
    ``{"split_waves": True}``; each checked when set; empty: the cores' defaults."""

    _CHECKS: ClassVar[dict[str, Callable[[str, Any], None]]] = {
        "unshared_plans": _check_bool,
        "hinted_plans": _check_bool,
        "delegate_unshared": _check_bool,
        "delegate_prefills": _check_bool,
        "count_fallbacks": _check_bool,
        "graph_slots_per_token": _check_slots,
        "core_options": _check_core,
    }

    def __setattr__(self, name: str, value: Any) -> None:
        check = self._CHECKS.get(name)
        if check is None:
            raise AttributeError(
                f"StepOptions has no option {name!r}; options: " + ", ".join(self._CHECKS)
            )
        check(name, value)
        if name == "core_options":  # a read-only copy: options objects never share it
            value = MappingProxyType(dict(value))
        object.__setattr__(self, name, value)

    def updated(self, changes: Mapping[str, Any]) -> StepOptions:
        """A copy with ``changes`` applied (each checked; an unknown name raises)."""
        new = dataclasses.replace(self)
        for name, value in changes.items():
            setattr(new, name, value)
        return new


_defaults = StepOptions()

COUNT_LOG_STEPS = 200
"""With :attr:`StepOptions.count_fallbacks`, :class:`StepPlanner` logs its counts every this many
planned steps."""

HINT_REFRESH_STEPS = 16
"""A decode run reuses the hint copied at its start for at most this many steps (see
:meth:`StepPlanner.plan_device`)."""


_BatchKey = tuple[int, "bytes | None", "bytes | None"]
"""A batch's identity across decode steps: its real requests, the rows they read (where the
engine says), their ids (where the engine has them)."""


def _batch_key(num_real: int, rows: Any, ids: Any) -> _BatchKey:
    return (
        num_real,
        None if rows is None else np.asarray(rows)[:num_real].tobytes(),
        None if ids is None else np.asarray(ids).tobytes(),
    )


@dataclasses.dataclass
class _Run:
    """A decode run: the batch and lengths of its first step, and the steps since."""

    key: _BatchKey
    lens: np.ndarray
    steps: int = 0

    def continued_by(self, key: _BatchKey, lens: np.ndarray) -> bool:
        """Is a step of batch ``key`` with lengths ``lens`` this run's next step (the same
        requests in the same rows, one token more each per step, fewer than
        :data:`HINT_REFRESH_STEPS` steps)? If so the run counts it."""
        steps = self.steps + 1
        if (
            self.key == key
            and steps < HINT_REFRESH_STEPS
            and np.array_equal(lens, self.lens + steps)
        ):
            self.steps = steps
            return True
        return False


@dataclasses.dataclass
class _RunHint:
    """The aligned hint of a decode run's first step and the run it serves."""

    run: _Run
    aligned: np.ndarray
    source: np.ndarray  # the hint it was aligned from
    checked: bool = False  # against the copy of the run's first step's own rows


def _agrees(aligned: np.ndarray, copy: np.ndarray) -> bool:
    """Do two hints of the same requests (row b: request b) hold the same page wherever both
    know it? A match of requests to rows by lengths alone can pair a request with another
    one's row (requests of equal lengths); the copy of the step's own rows cannot."""
    rows = min(aligned.shape[0], copy.shape[0])
    cols = min(aligned.shape[1], copy.shape[1])
    a, c = aligned[:rows, :cols], copy[:rows, :cols]
    known = (a >= 0) & (c >= 0)
    return bool(np.array_equal(a[known], c[known]))


def continued_rows(
    then: npt.ArrayLike,
    computed: npt.ArrayLike,
    max_gain: int,
    then_ids: npt.ArrayLike | None = None,
    ids: npt.ArrayLike | None = None,
) -> np.ndarray:
    """The hint row each current request continues (-1: none known).

    ``then``: each hint row's request length when the hint was copied (0: no request);
    ``computed``: each current request's tokens before this step (its length minus its new
    tokens). The result only says which pages a request is believed to have: a wrong guess
    costs the step its shared plan (the device check falls back), never a wrong result.

    With ``then_ids`` / ``ids`` (the engine's stable request ids of the hint rows and of the
    current requests, e.g. vLLM's request-state index; one per row and per request, else
    ValueError) a request continues the row of its id (if its length did not fall by more
    than ``max_gain``: a reused id of a new request). Ids that repeat are ignored (lengths
    decide).

    Without, by lengths, as engines move rows when requests leave (SGLang and vLLM's
    model runner keep their order and close the gaps; vLLM's older runner moves its last rows
    into them), in three passes:

    1. Exact gain, in order: a decode run's requests all took the same ``d`` tokens since the
       copy (``d`` is the gain most often shown by a request at its own row or one of the 8
       after it; skipped unless at least an eighth of the requests, and at least 2, show it,
       at as many distinct rows, two neighbours at least at the same shift). Request i
       continues row ``i + s`` (0 <= s <= 8) where its gain there is exactly ``d``; where
       several ``s`` match, the one whose matches run longest through the
       neighbouring requests (the gap-closing shift), not an isolated equal length.
    2. Its own row, then the free rows in order after the last one taken (up to 8 ahead),
       with gain ``d``; where pass 1 found no common gain (speculative decoding, whose
       rejected draft tokens vary the gains), any gain within ``max_gain``.
    3. Any free row with such a gain (the closest first; of equal rows the last).

    Worked example: ``then`` [100, 200, 300, 400], ``computed`` [100, 300, 400, 7] (the
    request of row 1 left, the others moved up, a new one came) -> [0, 2, 3, -1].
    """
    then = np.asarray(then, dtype=np.int64)
    computed = np.asarray(computed, dtype=np.int64)
    r, b = len(then), len(computed)
    out = np.full(b, -1, dtype=np.int64)
    if r == 0 or b == 0:
        return out
    if then_ids is not None and ids is not None:
        by_id = _rows_by_id(then, computed, max_gain, then_ids, ids)
        if by_id is not None:
            return by_id
    k = min(r, b)
    gain = computed[:k] - then[:k]
    if k == b and (then[:k] > 0).all() and 0 <= gain[0] <= max_gain and (gain == gain[0]).all():
        return np.arange(b, dtype=np.int64)  # a decode run: every request on its own row
    free = then > 0
    d = _exact_pass(then, computed, max_gain, out, free)
    # In a decode run every request that continues a row took exactly d tokens since the
    # copy: the later passes take no other gain (a new request of a similar length would
    # otherwise take a left request's row). Without a common gain (speculative decoding's
    # varied gains), anything within max_gain.
    gains = [d] if d is not None else sorted(range(-max_gain, max_gain + 1), key=abs)
    accepted = set(gains)
    todo = np.flatnonzero(out < 0)
    if not len(todo) or not free.any():
        return out
    own = todo[todo < r]
    stay = free[own] & np.isin(computed[own] - then[own], gains)
    out[own[stay]] = own[stay]
    free[own[stay]] = False
    todo = np.flatnonzero(out < 0)
    if not len(todo) or not free.any():
        return out
    after = np.flatnonzero(free).tolist()
    p = 0
    for i in todo.tolist():
        for q in range(p, min(p + 8, len(after))):
            j = after[q]
            if int(computed[i] - then[j]) in accepted:
                out[i], free[j], p = j, False, q + 1
                break
    todo = np.flatnonzero(out < 0)
    if not len(todo) or not free.any():
        return out
    left: dict[int, list[int]] = {}
    for j in np.flatnonzero(free).tolist():
        left.setdefault(int(then[j]), []).append(j)
    for i in todo.tolist():
        for g in gains:
            rows_left = left.get(int(computed[i]) - g)
            if rows_left:
                out[i] = rows_left.pop()  # the last: vLLM's older runner moves its last rows
                break
    return out


def _rows_by_id(
    then: np.ndarray,
    computed: np.ndarray,
    max_gain: int,
    then_ids: npt.ArrayLike,
    ids: npt.ArrayLike,
) -> np.ndarray | None:
    """:func:`continued_rows` by request ids; None where ids repeat (they identify nothing)."""
    r, b = len(then), len(computed)
    row_ids = np.asarray(then_ids, dtype=np.int64).reshape(-1)
    req_ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    if len(row_ids) != r or len(req_ids) != b:
        raise ValueError(
            f"continued_rows: {len(row_ids)} ids for {r} hint rows and {len(req_ids)} ids "
            f"for {b} requests; each row and each request needs one"
        )
    if len(np.unique(req_ids)) < b or len(np.unique(row_ids)) < r:
        return None
    order = np.argsort(row_ids, kind="stable")
    rows = order[np.minimum(np.searchsorted(row_ids[order], req_ids), r - 1)]
    ok = (row_ids[rows] == req_ids) & (then[rows] > 0) & (computed >= then[rows] - max_gain)
    return np.where(ok, rows, -1).astype(np.int64)


_SHIFTS = 9  # pass 1 of continued_rows: a request's own row and the 8 after it


def _exact_pass(
    then: np.ndarray, computed: np.ndarray, max_gain: int, out: np.ndarray, free: np.ndarray
) -> int | None:
    """Pass 1 of :func:`continued_rows` (fills ``out``, clears the rows taken in ``free``);
    returns the common gain, or None where there is none."""
    r, b = len(then), len(computed)
    rows = np.arange(b)[:, None] + np.arange(_SHIFTS)[None, :]  # [b, shifts]
    valid = rows < r
    rows = np.minimum(rows, r - 1)
    gain = computed[:, None] - then[rows]
    valid &= then[rows] > 0
    seen = gain[valid & (gain >= 0) & (gain <= max_gain)]
    if not len(seen):
        return None
    d = int(np.argmax(np.bincount(seen)))
    match = valid & (gain == d)
    # The length of the run of matches through each request at each shift: the shifts' columns
    # one after another, a non-match between them.
    flat = np.concatenate((match.T, np.zeros((_SHIFTS, 1), dtype=bool)), axis=1).ravel()
    start = flat & ~np.concatenate(([False], flat[:-1]))
    rid = np.cumsum(start)
    lengths = np.bincount(rid[flat], minlength=int(rid[-1]) + 1)
    run = np.where(flat, lengths[rid], 0).reshape(_SHIFTS, b + 1)[:, :b].T
    # A decode run's gain is shown by many requests, neighbours at the same shift; equal
    # lengths or a few coincidences show a gain at a handful of requests, each alone.
    least = max(2, min(r, b) // 8)
    if (
        len(np.unique(rows[match])) < least
        or np.count_nonzero(match.any(axis=1)) < least
        or int(run.max()) < 2
    ):
        return None  # no decode run's common gain (e.g. speculative decoding's varied gains)
    best = np.argmax(run, axis=1)  # the longest run; ties: the smallest shift
    has = run[np.arange(b), best] > 0
    cand = np.flatnonzero(has)
    target = cand + best[cand]
    strength = run[cand, best[cand]]
    # A row claimed twice goes to the longer run (then the earlier request).
    order = np.lexsort((cand, -strength))
    _, first = np.unique(target[order], return_index=True)
    keep = order[first]
    out[cand[keep]] = target[keep]
    free[target[keep]] = False
    return d


def graph_slots_per_token(options: StepOptions, max_context_len: int, max_requests: int) -> int:
    """(work item, token) slots reserved per token of a graph batch: ``options``'
    ``graph_slots_per_token``, else the core's :func:`~prefixattn.decode_slots_per_token` at
    the split floor its ``core_options`` give."""
    if options.graph_slots_per_token is not None:
        return options.graph_slots_per_token
    split_floor = options.core_options.get("min_split_tokens", DEFAULT_MIN_SPLIT_TOKENS)
    return decode_slots_per_token(max_context_len, max_requests, min_split_tokens=int(split_floor))


def configure(**changes: Any) -> StepOptions:
    """Set process-wide defaults for the :class:`StepPlanner` objects created afterwards, e.g.
    ``configure(hinted_plans=False)``; returns the new defaults. Engines that start worker
    processes need this in each of them (for example in a plugin that the engine loads in
    every process); vLLM users set ``additional_config={"prefixattn": {...}}`` instead."""
    global _defaults
    _defaults = _defaults.updated(changes)
    return default_options()


def default_options() -> StepOptions:
    """A copy of the process-wide defaults."""
    return dataclasses.replace(_defaults)


# ------------------------------------------------------------------ capability probes
def _kernels_loaded() -> bool:
    return bool(library.cuda_ops_available())


def cuda_graphs_available() -> bool:
    """True when :meth:`PrefixAttention.run` may be captured in a CUDA graph here and replayed
    with later plans.

    Both must hold: the core declares ``PrefixAttention.cuda_graph_safe`` (fixed-size launches
    that read every size from the plan's device buffers while capturing) and the compiled CUDA
    kernels are loaded (the PyTorch reference path is host-driven and cannot be captured).
    """
    if not getattr(PrefixAttention, "cuda_graph_safe", False):
        return False
    return _kernels_loaded()


def kernels_unavailable_reason(device: torch.device | str | None) -> str | None:
    """None when ``device`` is not a CUDA device or the compiled CUDA kernels are loaded;
    otherwise why an engine must not start: attention would run on the PyTorch reference,
    orders of magnitude slower, with nothing else telling the user."""
    if device is None or torch.device(device).type != "cuda" or _kernels_loaded():
        return None
    detail = library.kernels_status().removeprefix("not available: ")
    return (
        f"prefixattn: the compiled CUDA kernels are not available: {detail}. Without them "
        "attention would run on the slow PyTorch reference (`prefixattn info` shows what was "
        "found)."
    )


# ------------------------------------------------------------------ the planner
@dataclasses.dataclass(frozen=True)
class StepChoice:
    """How one step is planned (:meth:`StepPlanner.choose`)."""

    kind: StepKind
    """``"copy"``: :meth:`PrefixAttention.plan` from a host copy of the table;
    ``"unshared"`` / ``"hinted"``: from the device table, no wait."""
    hint: np.ndarray | None = None
    """The host table of an earlier step (``"hinted"`` only)."""

    @property
    def device_table(self) -> bool:
        """Does the step read its page ids from the device table (no host copy)?"""
        return self.kind != "copy"


class StepPlanner:
    """One engine's per-step planning state: the plan method of each step, the sharing probe
    and table hint that decide it, and the graph/eager :class:`PrefixAttention` pair.

    ``new_attention`` makes a :class:`PrefixAttention` for the engine's attention shape, KV
    layout and device (called at most twice: the eager object, then the graph one).
    ``page_size`` is the block size of the tables passed in. ``remedy`` ends the errors of
    :attr:`captured` (what the engine's user can change). ``options``: :class:`StepOptions`,
    default :func:`default_options`.

    A step::

        choice = planner.choose(num_real, decode=..., capture=..., device_table=..., graph=...)
        attention = planner.attention_for(graph=...)
        if choice.device_table:
            plan = planner.plan_device(attention, choice, device_table, seq_lens, qo_indptr,
                                       num_real=num_real)
        else:
            plan = planner.plan_host(attention, host_table, seq_lens, qo_indptr,
                                     num_real=num_real)
        if graph: planner.check()
    """

    def __init__(
        self,
        new_attention: Callable[[], PrefixAttention],
        page_size: int,
        *,
        options: StepOptions | None = None,
        remedy: str = "",
    ) -> None:
        self._new_attention = new_attention
        self.page_size = int(page_size)
        self.options = default_options() if options is None else options.updated({})
        self.probe = SharingProbe()
        self.table_hint = TableHint()
        self.captured = CapturedBuffers(remedy)
        """Guards the buffers of :attr:`graph_attention` that captured graphs read."""
        self.plan_kinds: dict[str, int] = {"copy": 0, "unshared": 0, "hinted": 0, "delegated": 0}
        """Steps planned from a host copy of their table, from lengths alone, from a hint, and
        steps run on the engine's own kernel (capture batches are not counted)."""
        self.host_seconds: dict[str, float] = dict.fromkeys(self.plan_kinds, 0.0)
        """Host time of the planning calls of each kind, summed (the step's plan, the look at
        its rows; what the engine's host spends on prefixattn besides launching the kernels)."""
        self.hint_rows: dict[str, int] = {"kept": 0, "moved": 0, "unknown": 0}
        """Requests of hinted steps by the hint row that describes them: their own row, another
        (the engine moved them), none (new, or no row matched: planned private)."""
        self._fallbacks: torch.Tensor | None = None  # hinted steps whose check failed
        self._next_log = COUNT_LOG_STEPS
        self.graph_attention: PrefixAttention | None = None
        """Plans the steps that may be replayed from captured graphs (:meth:`reserve_graphs`
        creates it)."""
        self._eager: PrefixAttention | None = None
        self._hint_view: tuple[np.ndarray, bytes, np.ndarray] | None = None
        self._hint_run: _Run | None = None
        """The run of the last step whose rows were copied as a hint; see
        :meth:`_hint_is_current`."""
        self._taught_by_running = False
        """The probe's verdict and the hint come from a batch that was not only prefills
        (:meth:`teaches`)."""
        self._run_hint: _RunHint | None = None
        """The aligned hint a decode run keeps using (:meth:`_continued_hint`)."""

    # ---------------------------------------------------------------- the pair
    @property
    def eager_attention(self) -> PrefixAttention:
        """Plans every step that is not replayed from a captured graph (created on first
        use)."""
        if self._eager is None:
            self._eager = self._new_core()
        return self._eager

    def _new_core(self) -> PrefixAttention:
        """A core from the engine's factory, with :attr:`StepOptions.core_options` set."""
        core = self._new_attention()
        for name, value in self.options.core_options.items():
            setattr(core, name, value)
        return core

    def attention_for(self, graph: bool) -> PrefixAttention:
        """The object that plans a step: :attr:`graph_attention` for a step that may be
        replayed from a captured graph, else :attr:`eager_attention`."""
        if not graph:
            return self.eager_attention
        if self.graph_attention is None:
            raise RuntimeError("prefixattn: a graph step before StepPlanner.reserve_graphs")
        return self.graph_attention

    def slots_per_token(self, max_context_len: int, max_requests: int) -> int:
        """(work item, token) slots reserved per graph token (:func:`graph_slots_per_token`)."""
        return graph_slots_per_token(self.options, max_context_len, max_requests)

    def spare_slots(self) -> int:
        """Slots reserved beyond the per-token ones: at least 1024, and what plans of small
        decode batches cut at the leaf floor may take (:func:`~prefixattn.leaf_split_spare`
        for :attr:`graph_attention`'s heads and split target, its SM count by default)."""
        core = self.graph_attention if self.graph_attention is not None else self.eager_attention
        target = core.split_target
        if target is None:
            target = sm_count(core.device)
        return max(1024, leaf_split_spare(core.num_qo_heads, core.num_kv_heads, target))

    def reserve_graphs(
        self, max_requests: int, max_tokens: int, max_context_len: int
    ) -> dict[str, int]:
        """Create :attr:`graph_attention` (once) and reserve its buffers for every decode
        batch of up to ``max_requests`` requests and ``max_tokens`` tokens with KV lengths up
        to ``max_context_len`` (:func:`~prefixattn.decode_reservation`); with hinted plans on,
        the fallback's buffers too, so captured graphs launch it. Returns the sizes."""
        if self.graph_attention is None:
            self.graph_attention = self._new_core()
        sizes = decode_reservation(
            max_requests,
            max_tokens,
            max_context_len,
            self.page_size,
            slots_per_token=self.slots_per_token(max_context_len, max_requests),
            spare_slots=self.spare_slots(),
        )
        self.graph_attention.reserve(**sizes, hinted=self.options.hinted_plans)
        return sizes

    def pin(self) -> None:
        """Record (or verify) the generation of :attr:`graph_attention`'s buffers: at capture."""
        self.captured.pin(self.attention_for(graph=True))

    def check(self) -> None:
        """Raise if a graph step's plan moved the buffers captured graphs read."""
        self.captured.check(self.attention_for(graph=True))

    # ---------------------------------------------------------------- the policy
    def choose(
        self,
        num_real: int,
        *,
        decode: bool,
        capture: bool = False,
        device_table: bool = True,
        graph: bool = False,
        delegate: bool = False,
        prefill_only: bool = False,
    ) -> StepChoice:
        """How to plan a step of ``num_real`` real requests.

        decode: at most one new token per request. capture: the engine's CUDA-graph capture
        batch (always copied). device_table: the engine can give the device table (int32)
        with exact host lengths (False: always copy). graph: the step may be replayed from a
        captured CUDA graph (:attr:`graph_attention`), whose hinted plans' fallback launches
        are those of decode steps: other steps of it are copied. delegate: the adapter can run
        this step on the engine's own kernel (never a graph step): ``"delegated"`` where the
        step would be planned unshared and :attr:`StepOptions.delegate_unshared` is on; the
        adapter then calls :meth:`delegated` instead of planning. prefill_only: the batch
        holds new requests' prefills alone (SGLang's extend batches), which a hinted plan
        would plan as private (no hint row knows them): such a batch is delegated where
        :attr:`StepOptions.delegate_prefills` is on.
        """
        if not device_table or capture or num_real <= 0:
            return StepChoice("copy")
        delegate = delegate and not graph
        expects_sharing = self.probe.expects_sharing()
        hint = self.table_hint.take() if self.options.hinted_plans else None
        # A batch of new prefills: the unshared plan and a hinted one alike plan each of its
        # requests private.
        prefills = delegate and prefill_only and self.options.delegate_prefills
        if prefills and (not expects_sharing or hint is not None):
            return StepChoice("delegated")
        if not expects_sharing:
            if delegate and self.options.delegate_unshared:
                return StepChoice("delegated")
            if self.options.unshared_plans:
                return StepChoice("unshared")
        if hint is not None and (decode or not graph):
            return StepChoice("hinted", hint)
        return StepChoice("copy")

    def plan_device(
        self,
        attention: PrefixAttention,
        choice: StepChoice,
        table: torch.Tensor,
        seq_lens: np.ndarray,
        qo_indptr: np.ndarray | None = None,
        *,
        num_real: int,
        rows: np.ndarray | None = None,
        private: np.ndarray | None = None,
        columns: int | None = None,
        ids: npt.ArrayLike | None = None,
        prefill_only: bool = False,
        whole: tuple[torch.Tensor, np.ndarray, npt.ArrayLike | None] | None = None,
    ) -> LaunchPlan:
        """Plan a step chosen ``"unshared"`` or ``"hinted"`` from the device ``table`` (int32,
        rows ``:num_real`` the real requests', later rows the engine's padding rows if any),
        then look at the batch on the side: its first pages for the probe, its rows
        (``columns`` of them, default all) as a later step's hint.

        ``seq_lens`` / ``qo_indptr`` (host) cover every planned request, padding included.
        ``rows`` / ``private`` are passed to :meth:`PrefixAttention.plan_unshared` /
        :meth:`~PrefixAttention.plan_hinted`: with ``rows`` the engine says which row each
        request reads (padding requests may read a real row, marked ``private``) and the hint
        is used whole; without, request b reads row b, so the hint's rows past ``num_real``
        are dropped (they describe another batch's requests, not this step's padding rows).
        ``ids``: the real requests' ids where the engine has them on the host (stable while
        a request runs, e.g. vLLM's request-state index): hints then follow requests by id
        (:func:`continued_rows`), else by lengths. ``prefill_only``: the batch holds new
        requests' prefills alone (SGLang's extend batches; :meth:`teaches`). ``whole``: the
        whole batch's device table, lengths and ids where the plan covers only its first
        requests (the others run on the engine's kernel): the look takes all of them.
        """
        t0 = time.perf_counter()
        plan = self._plan_device(
            attention, choice, table, seq_lens, qo_indptr, num_real=num_real, rows=rows,
            private=private, columns=columns, ids=ids, prefill_only=prefill_only, whole=whole,
        )  # fmt: skip
        self.host_seconds[choice.kind] += time.perf_counter() - t0
        if self.options.count_fallbacks:
            self._count(plan)  # after the time: its log line reads the device
        return plan

    def _plan_device(
        self,
        attention: PrefixAttention,
        choice: StepChoice,
        table: torch.Tensor,
        seq_lens: np.ndarray,
        qo_indptr: np.ndarray | None,
        *,
        num_real: int,
        rows: np.ndarray | None,
        private: np.ndarray | None,
        columns: int | None,
        ids: npt.ArrayLike | None,
        prefill_only: bool,
        whole: tuple[torch.Tensor, np.ndarray, npt.ArrayLike | None] | None = None,
    ) -> LaunchPlan:
        real_ids = None if ids is None else np.asarray(ids)[:num_real]
        # The batch and its lengths (a copy: engines refill their host buffers in place),
        # which the decode runs of the hint and of the rows' copy are kept by.
        key = _batch_key(num_real, rows, real_ids)
        lens = np.array(seq_lens[:num_real], dtype=np.int64)
        with record_function("prefixattn.plan"):
            if choice.kind == "unshared":
                plan = attention.plan_unshared(table, seq_lens, qo_indptr, rows=rows)
            elif choice.kind == "hinted":
                assert choice.hint is not None
                hint = self._continued_hint(key, lens, num_real, choice.hint)
                if hint is None:
                    hint, complete = self._aligned_hint(
                        choice.hint, seq_lens, qo_indptr, num_real, real_ids
                    )
                    # A hint that described every request is kept for the decode run this
                    # step may start (_continued_hint).
                    run = _Run(key, lens)
                    self._run_hint = _RunHint(run, hint, choice.hint) if complete else None
                plan = attention.plan_hinted(
                    table, hint, seq_lens, qo_indptr, rows=rows, private=private
                )
            else:
                raise ValueError(f"plan_device plans unshared or hinted steps, not {choice.kind}")
        if choice.kind != "hinted":
            self._run_hint = None
        self.plan_kinds[choice.kind] += 1
        if whole is None:
            self._look(table, key, lens, seq_lens, num_real, columns, real_ids, prefill_only)
        else:
            self._look_at(*whole, columns=columns, prefill_only=prefill_only)
        return plan

    def delegated(
        self,
        table: torch.Tensor,
        seq_lens: np.ndarray,
        *,
        num_real: int,
        rows: np.ndarray | None = None,
        columns: int | None = None,
        ids: npt.ArrayLike | None = None,
        prefill_only: bool = False,
    ) -> None:
        """A step chosen ``"delegated"``, which the engine's own kernel runs: no plan, only the
        look at its rows that :meth:`plan_device` takes (the probe's verdict, a later step's
        hint), with the same arguments."""
        t0 = time.perf_counter()
        self._run_hint = None
        self.plan_kinds["delegated"] += 1
        self._look_at(table, seq_lens, ids, num_real, rows, columns, prefill_only)
        self.host_seconds["delegated"] += time.perf_counter() - t0

    def _look_at(
        self,
        table: torch.Tensor,
        seq_lens: np.ndarray,
        ids: npt.ArrayLike | None,
        num_real: int | None = None,
        rows: np.ndarray | None = None,
        columns: int | None = None,
        prefill_only: bool = False,
    ) -> None:
        """:meth:`_look` at a batch's rows without planning it (``num_real`` None: every row
        of ``table``, a whole batch part of which the engine's kernel runs)."""
        n = table.shape[0] if num_real is None else num_real
        real_ids = None if ids is None else np.asarray(ids)[:n]
        lens = np.array(seq_lens[:n], dtype=np.int64)
        key = _batch_key(n, rows, real_ids)
        self._look(table, key, lens, seq_lens, n, columns, real_ids, prefill_only)

    def note_delegated(self) -> None:
        """Count a step that the engine's own kernel runs without a look at its rows (one
        that says nothing of sharing, e.g. a graph of one request's decode)."""
        self.plan_kinds["delegated"] += 1

    def _look(
        self,
        table: torch.Tensor,
        key: _BatchKey,
        lens: np.ndarray,
        seq_lens: np.ndarray,
        num_real: int,
        columns: int | None,
        real_ids: np.ndarray | None,
        prefill_only: bool,
    ) -> None:
        """Start the look at a device-table step's rows where it teaches: its first pages for
        the probe, its rows as a later step's hint (both land asynchronously)."""
        if not self.teaches(prefill_only=prefill_only) or self._hint_is_current(key, lens):
            # A decode run of the batch already looked at: its first pages (the probe's
            # verdict) and its rows (the hint) are those of the run's first step.
            return
        hints = self.options.hinted_plans
        if self.probe.in_flight() or (hints and self.table_hint.in_flight()):
            # An earlier look is still on its way (the host runs ahead of the GPU): this
            # batch is not looked at, and the next step looks again, instead of a decode run
            # of it taking its rows as known (new requests planned private for up to
            # HINT_REFRESH_STEPS steps). The probe and the hint look together, so they land
            # together and neither is copied again while the other is in flight.
            self._hint_run = None
            return
        first = table[:, 0]
        real = None
        if table.shape[0] > num_real:  # padding rows of the engine's table: left out
            real = torch.arange(table.shape[0], device=first.device) < num_real
        self.probe.start(first, real)
        if hints:
            # This step's rows: a later step's hint once landed.
            real_rows = table[:num_real] if columns is None else table[:num_real, :columns]
            self.table_hint.start(real_rows, seq_lens[:num_real], self.page_size, real_ids)

    def teaches(self, *, prefill_only: bool = False, capture: bool = False) -> bool:
        """Does a step set the probe's verdict and the hint for later steps? Not an engine's
        CUDA-graph capture batch (made-up rows); not a batch of new requests' prefills alone
        (``prefill_only``: SGLang's extend batches) once a batch of running requests has
        taught them. A decode batch after such a batch holds the requests before it plus its
        new ones, whose rows no hint knows either way (planned private), while its rows and
        sharing say nothing of the others: the next decode step was planned without sharing
        or from new requests' rows. Any other batch teaches (vLLM's, which mix prefill
        chunks with running requests; speculative decoding's steps of several tokens)."""
        if capture:
            return False
        if not prefill_only:
            self._taught_by_running = True
            return True
        return not self._taught_by_running

    def _continued_hint(
        self, key: _BatchKey, lens: np.ndarray, num_real: int, newest: np.ndarray
    ) -> np.ndarray | None:
        """The aligned hint of the step before, where this step continues that step's batch
        as a decode run (the same requests in the same rows, one token more each, fewer than
        :data:`HINT_REFRESH_STEPS` steps) and that hint described every request; else None.

        A step whose batch changed (a request left, rows moved) is planned from the newest
        hint and copies its own rows as the next hint. That copy describes the same requests
        and the same shared pages, but as a new array it would make the next step's plan be
        built afresh, where the plan of the step before can be advanced (one build per change
        of the batch, not two). Pages a request gained since the hint's copy are private, as
        a running request's new pages are. Once that copy has landed (``newest``, the hint
        the step was given), the kept hint is compared with it where both know a page: a
        request matched to another request's row ends the run, which then takes the copy."""
        kept = self._run_hint
        if kept is None:
            return None
        if not kept.run.continued_by(key, lens):
            self._run_hint = None
            return None
        if not kept.checked and newest is not kept.source:
            then = self.table_hint.lens
            if then is not None and np.array_equal(then, kept.run.lens):  # the first step's copy
                kept.checked = True
                if not _agrees(kept.aligned, newest):
                    self._run_hint = None
                    return None
        self.hint_rows["kept"] += num_real
        return kept.aligned

    def _aligned_hint(
        self,
        hint: np.ndarray,
        seq_lens: np.ndarray,
        qo_indptr: np.ndarray | None,
        num_real: int,
        ids: npt.ArrayLike | None = None,
    ) -> tuple[np.ndarray, bool]:
        """The hint's rows of the step's real requests, in their order: row b is the hint
        row request b continues (:func:`continued_rows`), -1 throughout for requests none
        describes (new ones, or ones that moved where no row matches). Requests past
        ``num_real`` read the engine's padding rows, which no hint describes. ``ids``: the
        real requests' ids, or None. The same array each step the alignment repeats (a
        decode run), so the planner can keep what it derived from it. Also: whether a row
        described every request."""
        lens = np.asarray(seq_lens[:num_real], dtype=np.int64)
        new: np.ndarray = np.ones(num_real, dtype=np.int64)
        if qo_indptr is not None:
            new = np.diff(np.asarray(qo_indptr, dtype=np.int64))[:num_real]
        then = self.table_hint.lens  # set with every hint, one length per row
        assert then is not None and len(then) == hint.shape[0]
        source = continued_rows(then, lens - new, HINT_REFRESH_STEPS, self.table_hint.ids, ids)
        kept = int(np.count_nonzero(source == np.arange(num_real)))
        unknown = int(np.count_nonzero(source < 0))
        self.hint_rows["kept"] += kept
        self.hint_rows["moved"] += num_real - kept - unknown
        self.hint_rows["unknown"] += unknown
        key = source.tobytes()
        view = self._hint_view
        if view is not None and view[0] is hint and view[1] == key:
            return view[2], unknown == 0
        if hint.shape[0] >= num_real and np.array_equal(source, np.arange(num_real)):
            aligned = hint[:num_real]
        else:
            if len(hint):
                # One gather of the rows, then the requests no row describes unknown.
                aligned = np.take(hint, np.maximum(source, 0), axis=0)
                aligned[source < 0] = -1
            else:
                aligned = np.full((num_real, hint.shape[1]), -1, dtype=hint.dtype)
            aligned.flags.writeable = False
        self._hint_view = (hint, key, aligned)
        return aligned, unknown == 0

    def counts(self) -> dict[str, Any]:
        """The planner's counts: :attr:`plan_kinds`, :attr:`hint_rows`, the mean host
        milliseconds of a planning call of each kind (:attr:`host_seconds`) and, with
        :attr:`StepOptions.count_fallbacks`, ``"fallbacks"``, the hinted steps whose device
        check failed (read from the device: waits for the GPU)."""
        out: dict[str, Any] = {"plans": dict(self.plan_kinds), "hint_rows": dict(self.hint_rows)}
        out["host_ms_per_plan"] = {
            kind: round(1e3 * self.host_seconds[kind] / n, 3)
            for kind, n in self.plan_kinds.items()
            if n
        }
        if self._fallbacks is not None:
            out["fallbacks"] = int(self._fallbacks.item())
        return out

    def _count(self, plan: LaunchPlan) -> None:
        """Add a hinted plan's check result to the fallback count; log the counts every
        :data:`COUNT_LOG_STEPS` planned steps."""
        taken = plan.fallback_taken
        if taken is not None:
            if self._fallbacks is None:
                self._fallbacks = torch.zeros((), dtype=torch.int64, device=taken.device)
            self._fallbacks.add_(taken)
        total = sum(self.plan_kinds.values())
        if total >= self._next_log:
            self._next_log = (total // COUNT_LOG_STEPS + 1) * COUNT_LOG_STEPS
            logger.warning("prefixattn step planner counts: %s", self.counts())

    def _hint_is_current(self, key: _BatchKey, lens: np.ndarray) -> bool:
        """True while the batch ``key`` (:func:`_batch_key`: its real requests, their rows
        and ids) is the one whose rows were last looked at, every request (``lens``, int64)
        some steps further by one token per step, for fewer than :data:`HINT_REFRESH_STEPS`
        steps: a decode run. Its pages past the copy are unknown to the hint, so planned as
        private, which a decode run's new pages are; copying the whole table again every step
        (O(requests x context) host work at page size 1) would tell nothing more, and its
        requests keep their first pages (the probe's verdict). Otherwise (requests joined, left, moved
        or took several tokens) the rows are looked at again."""
        if self._hint_run is not None and self._hint_run.continued_by(key, lens):
            return True
        self._hint_run = _Run(key, lens)
        return False

    def plan_host(
        self,
        attention: PrefixAttention,
        table: np.ndarray,
        seq_lens: np.ndarray,
        qo_indptr: np.ndarray | None = None,
        *,
        num_real: int,
        capture: bool = False,
        ids: npt.ArrayLike | None = None,
        prefill_only: bool = False,
        whole: tuple[np.ndarray, np.ndarray, npt.ArrayLike | None] | None = None,
    ) -> LaunchPlan:
        """Plan a step chosen ``"copy"`` with :meth:`PrefixAttention.plan` from the host
        ``table`` (rows ``:num_real`` the real requests', then any padding rows), after
        recording its sharing and its rows (with their ``ids``, as in :meth:`plan_device`)
        as a later step's hint where it teaches (:meth:`teaches`: not a capture batch).
        ``whole``: as in :meth:`plan_device`, on the host."""
        t0 = time.perf_counter()
        seen, seen_lens, seen_ids, n = table, seq_lens, ids, num_real
        if whole is not None:
            seen, seen_lens, seen_ids = whole
            n = seen.shape[0]
        if n > 0 and self.teaches(prefill_only=prefill_only, capture=capture):
            self.probe.observe(seen[:n, 0])
            if self.options.hinted_plans:
                real_ids = None if seen_ids is None else np.asarray(seen_ids)[:n]
                self.table_hint.observe(seen[:n], seen_lens[:n], self.page_size, real_ids)
                self._hint_run = None  # the next device-table step copies its rows again
        self._run_hint = None
        with record_function("prefixattn.plan"):
            plan = attention.plan(table, seq_lens, qo_indptr)
        if not capture:
            self.plan_kinds["copy"] += 1
            self.host_seconds["copy"] += time.perf_counter() - t0
        return plan
