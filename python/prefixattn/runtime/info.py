"""``prefixattn info``: what this environment can run, for bug reports and install checks."""

from __future__ import annotations

import importlib.metadata
from typing import Any

import torch

from . import compile as build

ENGINES = (("vllm", "vllm.general_plugins"), ("sglang", "sglang.srt.plugins"))
"""Engines with a prefixattn plugin, and the entry-point group each loads plugins from."""


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def collect() -> dict[str, Any]:
    """Versions, the GPU, the compiled library's state and the engine plugins, as a dict."""
    from . import library

    info: dict[str, Any] = {
        "prefixattn": _version("prefixattn") or "source tree",
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "nvcc": build.find_nvcc(),
    }
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        info["gpu"] = f"{torch.cuda.get_device_name()} (sm_{major}{minor})"
    else:
        info["gpu"] = None
    spec = build.default_spec()
    cached = build.build_info(spec)
    info["library"] = {
        "wanted": spec.tag,
        "cache": str(build.build_dir(spec)),
        "built": cached is not None,
        "compile_seconds": None if cached is None else cached.get("compile_seconds"),
        "loaded": library.loaded_path(),
    }
    info["kernels"] = library.kernels_status()
    plugins: dict[str, Any] = {}
    for engine, group in ENGINES:
        entry = [
            ep.value
            for ep in importlib.metadata.entry_points(group=group)
            if ep.value.startswith("prefixattn.")
        ]
        plugins[engine] = {"version": _version(engine), "plugin": entry[0] if entry else None}
    info["engines"] = plugins
    return info


def render(info: dict[str, Any]) -> str:
    lib = info["library"]
    lines = [
        f"prefixattn   {info['prefixattn']}",
        f"torch        {info['torch']} (CUDA {info['torch_cuda'] or 'none'})",
        f"GPU          {info['gpu'] or 'none'}",
        f"nvcc         {info['nvcc'] or 'not found'}",
        f"library      {lib['wanted']}: "
        + (
            f"built ({lib['compile_seconds']} s) in {lib['cache']}"
            if lib["built"]
            else f"not built yet (compiled on first use into {lib['cache']}; "
            "or run `prefixattn build`)"
        ),
        f"CUDA kernels {info['kernels']}",
    ]
    for engine, entry in info["engines"].items():
        if entry["version"] is None:
            state = "not installed"
        else:
            plugin = entry["plugin"] or "plugin entry point missing"
            state = f"{entry['version']}, plugin {plugin}"
        lines.append(f"{engine:<12} {state}")
    return "\n".join(lines)
