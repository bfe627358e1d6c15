"""The one loader of the compiled library (``_C``) and the probes of what it provides.

The library registers the ``prefixattn::build_plan`` CPU op (the native planner) and, when
built with CUDA, the ``prefixattn::run_plan`` kernels. It is loaded at most once per process,
on the first probe:

1. the ops may already be registered (the library was loaded by other code);
2. else the files named by ``PREFIXATTN_LIBRARY`` (a path list) are loaded (a library built by
   hand, e.g. with CMake);
3. else the library compiled for this torch and GPU is loaded from the cache, compiled first
   if it is not there yet (:mod:`prefixattn.runtime.compile`: about a minute for the planner,
   a few minutes with the kernels, once).

A failure to compile or load gives one warning and the package runs without the library:
plans are built by the Python planner (same plans, slower), and CUDA tensors are refused by
``PrefixAttention.run`` with :func:`kernels_status` as the reason.
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from pathlib import Path
from typing import Any

import torch

from . import compile as build

__all__ = [
    "cuda_ops_available",
    "kernels_status",
    "load_library",
    "loaded_path",
    "native_plan_available",
]

_OPS = ("build_plan", "run_plan")
_state: dict[str, Any] = {"path": None, "error": None, "no_kernels": None}


def _has_op(name: str) -> bool:
    return hasattr(torch.ops, "prefixattn") and hasattr(torch.ops.prefixattn, name)


def _load_file(path: Path) -> None:
    torch.ops.load_library(str(path))
    _state["path"] = str(path)


def _load() -> None:
    """Load (and if needed compile) the library; raise with the reason on failure."""
    env = os.environ.get("PREFIXATTN_LIBRARY")
    if env:
        for p in env.split(os.pathsep):
            if p:
                _load_file(Path(p))
        return
    spec = build.default_spec()
    if spec.cuda_archs and build.build_info(spec) is None and build.find_nvcc() is None:
        # Plans still work: build the planner alone, and say why CUDA tensors are refused.
        _state["no_kernels"] = (
            "nvcc was not found to compile the kernels for this GPU (set CUDA_HOME, or run "
            "`prefixattn build` where nvcc is and share the cache)"
        )
        spec = build.BuildSpec()
    _load_file(build.ensure_built(spec))


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
        try:
            _load()
        except (OSError, RuntimeError) as e:
            _state["error"] = str(e).splitlines()[0]
            warnings.warn(
                f"prefixattn: the compiled library is not available ({e}). Plans are built "
                "by the Python planner; CUDA tensors are refused.",
                RuntimeWarning,
                stacklevel=3,
            )
    if not any(_has_op(name) for name in _OPS):
        return False
    _register_fakes()
    return True


def loaded_path() -> str | None:
    """The library file this process loaded, if any."""
    return _state["path"]


def native_plan_available() -> bool:
    """True when the compiled library provides ``prefixattn::build_plan``."""
    return load_library() and _has_op("build_plan")


@functools.lru_cache(maxsize=1)
def cuda_ops_available() -> bool:
    """True when the library was built with the CUDA kernels and a CUDA device is present."""
    return kernels_status() == "available"


@functools.lru_cache(maxsize=1)
def kernels_status() -> str:
    """``"available"``, or why the CUDA kernels cannot run in this process."""
    reason = build.device_problem()
    if reason is not None:
        return f"not available: {reason}"
    if not load_library():
        return f"not available: the compiled library failed to build or load ({_state['error']})"
    if not _has_op("run_plan") or not torch._C._dispatch_has_kernel_for_dispatch_key(
        "prefixattn::run_plan", "CUDA"
    ):
        where = _state["path"] or "an already loaded library"
        why = _state["no_kernels"] or f"{where} was built without the CUDA kernels"
        return f"not available: {why}"
    return "available"
