"""Step and core options for SGLang's prefixattn backend in a benchmark's engine (every
process).

SGLang builds its attention backend in spawned scheduler processes and has no per-backend
settings; :func:`prefixattn.engine.step.configure` must run in each of them before the
backend is built. :func:`plugin_env` writes a distribution whose ``sglang.srt.plugins``
entry point does that with the given options (SGLang's ``load_plugins()`` runs it in every
process) and returns the environment that puts it on ``sys.path``. Benchmark-only, like the
``noattn`` bound (``tools/sglang/noattn.py``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tools.sglang.noattn import plugin_distribution
from tools.variants import parse_variant

DIST = "prefixattn_bench_core_options"
MODULE = "prefixattn_bench_core_options"
ENTRY_POINT = "prefixattn_bench_core_options"


def plugin_env(
    folder: Path, changes: dict[str, Any], base: dict[str, str] | None = None
) -> dict[str, str]:
    """Write the plugin (a module that calls ``configure(**changes)``, with
    :class:`~prefixattn.engine.step.StepOptions` changes as
    :func:`tools.variants.parse_variant` gives them, and its ``*.dist-info``) into
    ``folder``; return ``base`` (default ``os.environ``) with ``folder``
    and the repository root first on ``PYTHONPATH`` and the entry point added to
    ``SGLANG_PLUGINS`` when that whitelist is set."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{MODULE}.py").write_text(
        "import json\n\nfrom prefixattn.engine.step import configure\n\n"
        f"CHANGES = json.loads({json.dumps(changes)!r})\n\n\n"
        "def register() -> None:\n    configure(**CHANGES)\n"
    )
    return plugin_distribution(folder, DIST, ENTRY_POINT, f"{MODULE}:register", base)


def engine_env(
    backend: str,
    folder: Path,
    bound: bool,
    floor_tokens: int | None = None,
    read_floor: bool = False,
) -> dict[str, str] | None:
    """The environment of ``backend``'s SGLang engine, which all its processes inherit: with
    ``bound``, the attention-free bound's plugin (``folder/noattn-plugin``,
    ``tools/sglang/noattn.py``); with ``floor_tokens``, the ``prefixfloor`` plugin of that
    prefix length (``folder/floor-plugin``); with ``read_floor``, the ``kvfloor`` plugin
    (``folder/kvfloor-plugin``); for a variant with options
    (``tools/variants.py``), a plugin that sets them (``folder/core-options``); else None (the
    benchmark's own)."""
    if bound:
        from tools.sglang.noattn import plugin_env as bound_env

        return bound_env(folder / "noattn-plugin")
    if floor_tokens is not None:
        from tools.sglang.noattn import floor_plugin_env

        return floor_plugin_env(folder / "floor-plugin", floor_tokens)
    if read_floor:
        from tools.sglang.noattn import kv_floor_plugin_env

        return kv_floor_plugin_env(folder / "kvfloor-plugin")
    _, changes = parse_variant(backend)
    return plugin_env(folder / "core-options", changes) if changes else None
