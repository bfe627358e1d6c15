"""The tuning knobs of :class:`~prefixattn.PrefixAttention`, with their defaults.

:class:`PlanOptions` are read by ``plan*`` (host work), :class:`LaunchOptions` by ``run``.
Every field is checked when it is set (at construction or later): a wrong type raises
``TypeError`` and a value out of range ``ValueError``, both naming the option. This module
imports nothing of the package, so every stage may refer to it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

_INT32_MAX = 2**31 - 1
_INT64_MAX = 2**63 - 1

DEFAULT_MAX_PLAN_BYTES = 8 * 2**30
"""``PlanOptions.max_plan_bytes`` by default: 8 GiB."""

DEFAULT_MIN_SPLIT_TOKENS = 256
"""``PlanOptions.min_split_tokens`` by default."""

DEFAULT_LEAF_SPLIT_TOKENS = 64
"""``PlanOptions.leaf_split_tokens`` by default."""


def _check_bool(owner: str, name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{owner}.{name} must be a bool, got {value!r}")


def _check_count(
    owner: str, name: str, value: Any, optional: bool = False, top: int = _INT32_MAX
) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        what = "None or an int" if optional else "an int"
        raise TypeError(f"{owner}.{name} must be {what}, got {value!r}")
    if not 0 <= value <= top:
        raise ValueError(f"{owner}.{name} must be in [0, {top}], got {value}")


def _check_positive(owner: str, name: str, value: Any, top: int = _INT32_MAX) -> None:
    _check_count(owner, name, value, top=top)
    if value < 1:
        raise ValueError(f"{owner}.{name} must be in [1, {top}], got {value}")


class _Checked:
    """Dataclass base whose fields are validated on every assignment."""

    _CHECKS: ClassVar[dict[str, Any]] = {}

    def __setattr__(self, name: str, value: Any) -> None:
        check = self._CHECKS.get(name)
        if check is None:
            raise AttributeError(
                f"{type(self).__name__} has no option {name!r}; options: " + ", ".join(self._CHECKS)
            )
        check(type(self).__name__, name, value)
        object.__setattr__(self, name, value)


@dataclasses.dataclass(eq=True, repr=True)
class PlanOptions(_Checked):
    """How ``PrefixAttention.plan*`` builds plans."""

    native_plan: bool = True
    """Build plans with the compiled planner when it is installed (identical output to the
    Python ``build_forest`` + ``pack``, which is used otherwise or when False)."""

    split_target: int | None = None
    """(work item, KV head) pairs the GPU runs at once; None (default): the device's SM count,
    read at the first plan (``DEFAULT_SPLIT_TARGET`` for a CPU device), which then stays
    here. A long row chunk is split only where its KV is more than twice its launch's KV
    tokens per SM (``prefixattn.plan.packing``); 0 splits every long item. Any value up to
    2**63 - 1 is exact; beyond some multiple of the batch's KV tokens a larger one changes
    nothing (every long item is cut as finely as the split floor allows)."""

    pack_heads: bool = True
    """Let the 16-row kernel cover several KV heads per (item, KV head) pair where the items'
    rows fit and the launch keeps at least ``split_target`` pairs
    (``prefixattn.plan.layout.packed_heads``): fewer, larger pairs for short decode items
    (docs/dev/log.md, v14). False: one KV head per pair."""

    finish_in_leaf: bool = True
    """Plans let the leaf kernel (16-row tiles, head_dim <= 128) finish the merged tokens with
    exactly one slot in its items: the CUDA launcher then runs the leaf launch after the other
    forward launches, and its warps merge those tokens' other partial rows into the output, so
    the merge launch takes only the rest (``prefixattn.plan.packing.finish_in_leaf``;
    docs/dev/log.md, v25). False: every merged token goes through the merge launch, and
    the leaf launch runs first. ``run`` reads it too."""

    one_launch_in_one_wave: bool = True
    """When all (work item, KV head) pairs of a plan fit in one wave (at most
    ``split_target``), give every item the plan's largest tile height, so that the forward
    kernels run as one launch instead of one per height (docs/dev/log.md, v8). False:
    each item keeps its own tile height."""

    split_waves: bool = True
    """With a split target, cut the split row chunks of each launch into fewer parts where
    the launch's estimated makespan is shorter (whole waves of the SMs instead of a last,
    partly filled round; ``prefixattn.plan.packing.fill_waves``, the same in the compiled
    planner; docs/dev/log.md, "Whole waves for split launches"). False: the split rule's
    parts."""

    min_split_tokens: int = DEFAULT_MIN_SPLIT_TOKENS
    """The split floor: a long-KV split part is never shorter than this many KV tokens (a
    chunk shorter than twice it is not split). Shorter parts add partial rows for the merge
    and per-pair start cost; longer ones leave SMs idle where a launch has few pairs. Values
    below the page size act as the page size (parts are whole pages)."""

    leaf_split_tokens: int = DEFAULT_LEAF_SPLIT_TOKENS
    """The split floor instead of ``min_split_tokens`` for plans whose row chunks all take
    the leaf kernel's 16-row tiles (head_dim <= 128; with a split target): small decode
    batches, where a few long pairs, one warp each, would leave most SMs idle. 64 (default)
    took one request of 1408 tokens from 24.0 to 15.5 us on an H200 (docs/dev/log.md, "The
    split floor of small decode batches")."""

    max_plan_bytes: int | None = DEFAULT_MAX_PLAN_BYTES
    """Refuse (``MemoryError``) to build a plan whose estimated host memory is larger than
    this many bytes; None: no limit. The estimate is taken from the lengths alone before any
    planning (``prefixattn.plan.planner.estimate_plan``): mostly the page ids of every row
    chunk, which at page size 1 grow with query tokens x context (a 64K-token prefill chunk
    into a 1M-token context lists about 2e9 page ids). Default 8 GiB, the same on every
    machine, so that a batch planned on one host is planned on another."""

    _CHECKS: ClassVar[dict[str, Any]] = {
        "native_plan": _check_bool,
        "split_target": lambda o, n, v: _check_count(o, n, v, optional=True, top=_INT64_MAX),
        "pack_heads": _check_bool,
        "finish_in_leaf": _check_bool,
        "one_launch_in_one_wave": _check_bool,
        "split_waves": _check_bool,
        "min_split_tokens": _check_positive,
        "leaf_split_tokens": _check_positive,
        "max_plan_bytes": lambda o, n, v: _check_count(o, n, v, optional=True, top=_INT64_MAX),
    }


@dataclasses.dataclass(eq=True, repr=True)
class LaunchOptions(_Checked):
    """How ``PrefixAttention.run`` launches a plan on the CUDA kernels."""

    use_kernels: bool = True
    """CUDA tensors run on the CUDA kernels, and ``run`` raises where the kernels cannot run
    them (not compiled for this GPU, or not float16/bfloat16). False is the explicit opt-in to
    the slow PyTorch reference on CUDA tensors. CPU tensors always run on the reference."""

    prefetch_tiles: int = 0
    """Prefetch KV into L2 this many 64-token tiles ahead of the copies
    (``cp.async.bulk.prefetch.L2``); 0 turns it off (see docs/dev/log.md)."""

    fixed_grid: bool = False
    """Launch the plan-independent grids used under graph capture even when not capturing
    (for tests and measurements)."""

    concurrent_groups: bool = False
    """Run the tile groups (one launch per query-tile height) on forked streams at once
    instead of one after another on the caller's stream (not measured yet; see
    docs/dev/log.md)."""

    chain_launches: bool = True
    """Let each launch of a call after the first (the next tile height, the merge) start while
    the one before it drains (programmatic dependent launch), so the launches overlap at their
    tails; off, each waits for the one before to finish. On by default since the leaf kernel:
    6.4% less time over the suite, at worst 1.0% more on one configuration
    (docs/dev/log.md, v17 and "Chained launches with the leaf kernel")."""

    _CHECKS: ClassVar[dict[str, Any]] = {
        "use_kernels": _check_bool,
        "prefetch_tiles": _check_count,
        "fixed_grid": _check_bool,
        "concurrent_groups": _check_bool,
        "chain_launches": _check_bool,
    }


PLAN_OPTIONS = tuple(f.name for f in dataclasses.fields(PlanOptions))
LAUNCH_OPTIONS = tuple(f.name for f in dataclasses.fields(LaunchOptions))
