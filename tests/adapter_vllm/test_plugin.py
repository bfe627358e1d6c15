"""The installed entry point registers prefixattn in vLLM's CUSTOM slot."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

BACKEND = "prefixattn.adapters.vllm.backend.PrefixAttentionBackend"


def test_entry_point_is_installed() -> None:
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    ours = [ep for ep in eps if ep.name == "prefixattn"]
    assert len(ours) == 1
    assert ours[0].value == "prefixattn.adapters.vllm.plugin:register"
    assert callable(ours[0].load())


def test_load_general_plugins_resolves_custom() -> None:
    # A fresh interpreter: vLLM loads general plugins once per process.
    code = f"""
from vllm.plugins import load_general_plugins
from vllm.v1.attention.backends.registry import AttentionBackendEnum
load_general_plugins()
cls = AttentionBackendEnum.CUSTOM.get_class()
assert AttentionBackendEnum.CUSTOM.get_path() == {BACKEND!r}, AttentionBackendEnum.CUSTOM.get_path()
assert cls.get_name() == "CUSTOM"
assert AttentionBackendEnum[cls.get_name()] is AttentionBackendEnum.CUSTOM
print("ok", cls.__module__, cls.__qualname__)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ok prefixattn.adapters.vllm.backend PrefixAttentionBackend" in done.stdout


def test_register_is_idempotent() -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from prefixattn.adapters.vllm.plugin import register

    register()
    register()
    assert AttentionBackendEnum.CUSTOM.get_path() == BACKEND


def test_importing_prefixattn_does_not_import_vllm() -> None:
    code = (
        "import sys, prefixattn, prefixattn.adapters.vllm.plugin;"
        "assert not any(m == 'vllm' or m.startswith('vllm.') for m in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_matrix_models_are_valid_llama_configs() -> None:
    """Every head configuration of the integration matrix gives a config transformers takes."""
    from transformers import LlamaConfig

    from tools.matrix import run_matrix as m

    for heads in m.AXES["heads"]:
        for d in m.AXES["head_dim"]:
            cfg = LlamaConfig(**m.model_config(m.Cell("vllm", heads, d, "none", "off", 1)))
            assert cfg.head_dim == d
