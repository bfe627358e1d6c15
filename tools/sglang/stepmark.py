"""Benchmark-only SGLang plugin: a profiler range around each forward pass.

SGLang's scheduler names no range per engine step in its torch-profiler traces. The serving
benchmark's profiles split the traced steps by kind (``tools/trace_summary.step_kinds``),
which needs one host event at the start of every step: :func:`register` wraps
``ModelRunner.forward`` (called once per batch, decode, extend or mixed) in
``torch.profiler.record_function(MARKER)``. Outside a profile the range costs a few
microseconds per step, the same for every backend. :func:`plugin_env` writes the plugin's
distribution (an ``sglang.srt.plugins`` entry point, as ``tools/sglang/noattn.py`` does), so
SGLang's ``load_plugins()`` runs it in the scheduler too.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

MARKER = "sglang.forward"
# Underscores: a distribution folder named "prefixattn-bench-stepmark-0.0.dist-info" parses
# as the distribution "prefixattn", which then hides the installed package's entry point.
DIST = "prefixattn_bench_stepmark"


def register() -> None:
    """Wrap ``ModelRunner.forward`` in the :data:`MARKER` range (once per process)."""
    import torch

    try:
        from sglang.srt.model_executor.model_runner import ModelRunner
    except ImportError as e:  # a process of SGLang's without the model runner's imports
        print(f"{DIST}: no step marker in this process ({e})", flush=True)
        return
    if getattr(ModelRunner.forward, "_step_marker", False):
        return
    forward = ModelRunner.forward

    @functools.wraps(forward)
    def marked(self: Any, *args: Any, **kwargs: Any) -> Any:
        with torch.profiler.record_function(MARKER):
            return forward(self, *args, **kwargs)

    marked._step_marker = True  # type: ignore[attr-defined]
    ModelRunner.forward = marked


def plugin_env(folder: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment (``base``, default this process's) with the plugin in ``folder``."""
    from tools.sglang.noattn import plugin_distribution

    return plugin_distribution(folder, DIST, DIST, f"{__name__}:register", base)
