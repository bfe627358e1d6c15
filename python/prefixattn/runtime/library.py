"""The one loader of the compiled library (``_C``) and the probes of what it provides.

The library registers the ``prefixattn::build_plan`` CPU op (the native planner) and, when
built with CUDA, the ``prefixattn::run_plan`` kernels. It is loaded at most once, on the
first probe: the ops may already be registered (the library was loaded by other code);
otherwise the files named by ``PREFIXATTN_LIBRARY`` (a path list), or else the shared
libraries in the package's directory and among the installed distribution's files, are
loaded until one provides the ops. A library that fails to load (for example one built
against another torch) gives one warning, and the package runs without it: plans are built
in Python and run on the PyTorch reference.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import os
import warnings
from pathlib import Path
from typing import Any

import torch

__all__ = ["cuda_ops_available", "load_library", "native_plan_available"]

_PACKAGE_DIR = Path(__file__).resolve().parents[1]
_OPS = ("build_plan", "run_plan")
_failed: set[str] = set()


def _has_op(name: str) -> bool:
    return hasattr(torch.ops, "prefixattn") and hasattr(torch.ops.prefixattn, name)


def _candidates() -> list[Path]:
    """Shared libraries that may hold the ops: ``PREFIXATTN_LIBRARY`` (path list) if set, else
    those in the package's directory and those installed with the distribution."""
    env = os.environ.get("PREFIXATTN_LIBRARY")
    if env:
        return [Path(p) for p in env.split(os.pathsep) if p]
    suffixes = (".so", ".pyd", ".dylib")
    found = sorted(p for p in _PACKAGE_DIR.iterdir() if p.suffix in suffixes)
    try:
        dist_files = importlib.metadata.files("prefixattn") or []
    except importlib.metadata.PackageNotFoundError:
        dist_files = []
    for f in dist_files:
        if f.suffix in suffixes:
            path = Path(str(f.locate())).resolve()
            if path not in found:
                found.append(path)
    return found


def _load_file(path: Path) -> bool:
    """Load one library file; on failure warn once per file."""
    try:
        torch.ops.load_library(str(path))
        return True
    except (OSError, RuntimeError) as e:
        if str(path) not in _failed:
            _failed.add(str(path))
            warnings.warn(
                f"prefixattn: could not load {path} ({e}); it may have been built against "
                f"another torch than {torch.__version__}. Without it plans are built in Python "
                "and run on the PyTorch reference; rebuild prefixattn in this environment "
                "(pip install --no-build-isolation --no-deps .).",
                RuntimeWarning,
                stacklevel=4,
            )
        return False


def _register_fakes() -> None:
    """Shapes for tracing (FakeTensor, torch.compile)."""

    def build_plan_fake(block_table: torch.Tensor, *args: Any) -> tuple[torch.Tensor, ...]:
        # Every output size is data-dependent.
        ctx = torch.library.get_ctx()
        return (
            block_table.new_empty(ctx.new_dynamic_size(), dtype=torch.int32),
            block_table.new_empty(ctx.new_dynamic_size(), dtype=torch.int64),
            block_table.new_empty(ctx.new_dynamic_size(), dtype=torch.int32),
        )

    def run_plan_fake(*args: object) -> None:
        return None

    for name, fake in (("build_plan", build_plan_fake), ("run_plan", run_plan_fake)):
        if _has_op(name):
            with contextlib.suppress(RuntimeError):  # a fake may already be registered
                torch.library.register_fake(f"prefixattn::{name}", fake)


@functools.lru_cache(maxsize=1)
def load_library() -> bool:
    """Load the compiled library once; True when it provides any of the ops."""
    if not all(_has_op(name) for name in _OPS):
        for path in _candidates():
            if _load_file(path) and all(_has_op(name) for name in _OPS):
                break
    if not any(_has_op(name) for name in _OPS):
        return False
    _register_fakes()
    return True


def native_plan_available() -> bool:
    """True when the compiled library provides ``prefixattn::build_plan``."""
    return load_library() and _has_op("build_plan")


@functools.lru_cache(maxsize=1)
def cuda_ops_available() -> bool:
    """True when the library was built with the CUDA kernels and a CUDA device is present."""
    if not torch.cuda.is_available() or not load_library() or not _has_op("run_plan"):
        return False
    return bool(torch._C._dispatch_has_kernel_for_dispatch_key("prefixattn::run_plan", "CUDA"))
