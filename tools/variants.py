"""Backend variants of the benchmarks: a backend name with options after ``+``.

``prefixattn+split_waves`` is SGLang's ``prefixattn`` backend whose cores take
``PlanOptions.split_waves = True``; ``CUSTOM+split_target=66+chain_launches=false`` is vLLM's,
with two options. A value is JSON (``true``, ``66``); an option alone means ``true``. A name
of a :class:`prefixattn.engine.step.StepOptions` field sets that field
(``prefixattn+count_fallbacks``); any other name is one of its ``core_options``
(:class:`~prefixattn.PlanOptions` and :class:`~prefixattn.LaunchOptions` fields); all are
checked when parsed. vLLM engines take them as ``additional_config={"prefixattn": ...}``;
SGLang schedulers from a plugin (:func:`tools.sglang.core_options.plugin_env`).
"""

from __future__ import annotations

import argparse
import json
from typing import Any


def parse_variant(name: str, ours: str | None = None) -> tuple[str, dict[str, Any]]:
    """``(backend, changes)`` of a benchmark backend name: ``changes`` are
    :meth:`StepOptions.updated <prefixattn.engine.step.StepOptions.updated>`'s, core options
    under ``"core_options"``. With ``ours`` (prefixattn's backend name in the engine), options
    on any other backend raise.

    Worked example: ``"CUSTOM+split_target=66+count_fallbacks"`` -> ``("CUSTOM",
    {"count_fallbacks": True, "core_options": {"split_target": 66}})``; ``"FLASH_ATTN"`` ->
    ``("FLASH_ATTN", {})``.
    """
    base, *parts = name.split("+")
    if not base:
        raise ValueError(f"backend variant {name!r}: no backend before '+'")
    if parts and ours is not None and base != ours:
        raise ValueError(f"backend variant {name!r}: core options apply to {ours} only")
    options: dict[str, Any] = {}
    for part in parts:
        key, sep, raw = part.partition("=")
        if not key:
            raise ValueError(f"backend variant {name!r}: an empty option")
        try:
            options[key] = json.loads(raw) if sep else True
        except json.JSONDecodeError as e:
            raise ValueError(f"backend variant {name!r}: {key}={raw!r} is not JSON") from e
    if not options:
        return base, {}
    from prefixattn.engine.step import StepOptions

    step = {k: v for k, v in options.items() if k in StepOptions._CHECKS and k != "core_options"}
    core = {k: v for k, v in options.items() if k not in step}
    changes: dict[str, Any] = dict(step, core_options=core) if core else step
    StepOptions().updated(changes)  # unknown names and wrong values raise here
    return base, changes


def check_variants(ap: argparse.ArgumentParser, names: list[str], ours: str) -> list[str]:
    """The backends of ``names`` (:func:`parse_variant`); a bad variant exits through
    ``ap.error`` with the reason, before any engine starts."""
    bases = []
    for name in names:
        try:
            bases.append(parse_variant(name, ours=ours)[0])
        except (ValueError, TypeError, AttributeError) as e:
            ap.error(str(e))
    return bases
