"""Core options for SGLang's prefixattn backend in a benchmark's engine (every process).

SGLang builds its attention backend in spawned scheduler processes and has no per-backend
settings; :func:`prefixattn.engine.step.configure` must run in each of them before the
backend is built. :func:`plugin_env` writes a distribution whose ``sglang.srt.plugins``
entry point does that with the given options (SGLang's ``load_plugins()`` runs it in every
process) and returns the environment that puts it on ``sys.path``. Benchmark-only, like the
``noattn`` bound (``tools/sglang/noattn.py``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tools.sglang.noattn import REPO_ROOT

DIST = "prefixattn_bench_core_options"
MODULE = "prefixattn_bench_core_options"
ENTRY_POINT = "prefixattn_bench_core_options"


def plugin_env(
    folder: Path, core_options: dict[str, Any], base: dict[str, str] | None = None
) -> dict[str, str]:
    """Write the plugin (a module that calls ``configure(core_options=...)`` and its
    ``*.dist-info``) into ``folder``; return ``base`` (default ``os.environ``) with ``folder``
    and the repository root first on ``PYTHONPATH`` and the entry point added to
    ``SGLANG_PLUGINS`` when that whitelist is set."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{MODULE}.py").write_text(
        "import json\n\nfrom prefixattn.engine.step import configure\n\n"
        f"OPTIONS = json.loads({json.dumps(core_options)!r})\n\n\n"
        "def register() -> None:\n    configure(core_options=OPTIONS)\n"
    )
    info = folder / f"{DIST}-0.0.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {DIST}\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text(
        f"[sglang.srt.plugins]\n{ENTRY_POINT} = {MODULE}:register\n"
    )
    env = dict(os.environ if base is None else base)
    paths = [str(folder), str(REPO_ROOT)] + [p for p in [env.get("PYTHONPATH", "")] if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    if env.get("SGLANG_PLUGINS"):
        env["SGLANG_PLUGINS"] = f"{env['SGLANG_PLUGINS']},{ENTRY_POINT}"
    return env
