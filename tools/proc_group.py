"""Run a command in a process group of its own and leave nothing of it behind.

Engines start helper processes (vLLM's engine core, SGLang's scheduler and detokenizer); killing
the whole group when the command returns or runs out of time frees the GPU for the next run.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path


def run_in_group(
    cmd: list[str], timeout: float, log: Path | None = None, env: dict[str, str] | None = None
) -> int | str:
    """Run ``cmd`` (stdout and stderr to ``log`` when given); return its exit code, or
    ``"timeout after N s"`` when it ran out of ``timeout`` seconds."""
    with contextlib.ExitStack() as stack:
        out = stack.enter_context(log.open("w")) if log is not None else None
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT if out else None, env=env,
            start_new_session=True,
        )  # fmt: skip
        try:
            return proc.wait(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            return f"timeout after {timeout:.0f} s"
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
