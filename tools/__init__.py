"""Engine checks, benchmarks and the integration matrix for prefixattn in vLLM and SGLang.

Run the scripts as modules from the repository root, e.g.
``python -m tools.vllm.check_engine --out DIR``; see ``docs/engines.md``.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
from pathlib import Path
from typing import Any

RESULTS = Path("prefixattn-results")
"""Default folder of the tools' reports and logs, in the current directory (results stay out
of the source tree; the repository keeps only the current summary in docs/)."""


def write_atomic(path: Path, data: Any) -> None:
    """Write ``data`` as JSON through a temporary file: a worker killed at its timeout leaves
    the previous complete result, never a truncated one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def installed_version(package: str) -> str | None:
    """The installed distribution's version (recorded with benchmark results), or None."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None
