"""tools/plot_e2e.py on results in both benchmarks' formats."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools import plot_e2e

# The shapes of tools/vllm/bench_decode.py's and tools/sglang/bench_decode.py's JSON.
VLLM_RESULT = {
    "engine_version": "0.33.0",
    "step_ms": {
        "CUSTOM": {"shared1": {"64": 6.1, "256": 11.804}, "none": {"256": 20.5}},
        "FLASH_ATTN": {"shared1": {"256": 30.2}, "none": {"256": 21.0}},
        "FLASHINFER": {"shared1": {"256": 25.0}},
    },
}
SGLANG_RESULT = {
    "engine_version": "0.5.23",
    "backends": {
        "prefixattn": {"step_ms": {"shared1:4096": 13.785, "none:1024": 9.0}},
        "flashinfer": {"step_ms": {"shared1:4096": 24.707}},
        "triton": {"step_ms": {"shared1:4096": 41.661}, "error": "exited 1 after 3 s"},
    },
}


@pytest.fixture
def results(tmp_path: Path) -> tuple[Path, Path]:
    vllm, sglang = tmp_path / "vllm.json", tmp_path / "sglang.json"
    vllm.write_text(json.dumps(VLLM_RESULT))
    sglang.write_text(json.dumps(SGLANG_RESULT))
    return vllm, sglang


def test_table_reads_both_result_formats(results) -> None:
    table = plot_e2e.decode_table(*results)
    vllm, sgl = table["vLLM 0.33.0"], table["SGLang 0.5.23"]
    # Batch 256 only: the 64-request point of CUSTOM is left out.
    assert vllm == {
        "shared1": {"CUSTOM": 11.804, "FLASH_ATTN": 30.2, "FLASHINFER": 25.0},
        "none": {"CUSTOM": 20.5, "FLASH_ATTN": 21.0},
    }
    assert sgl["shared1:4096"] == {"prefixattn": 13.785, "flashinfer": 24.707, "triton": 41.661}
    assert sgl["none:1024"] == {"prefixattn": 9.0}


def test_label_without_a_recorded_version(tmp_path: Path) -> None:
    path = tmp_path / "vllm.json"
    path.write_text(json.dumps({"step_ms": VLLM_RESULT["step_ms"]}))
    assert list(plot_e2e.decode_table(path, None)) == ["vLLM"]


def test_plot_writes_a_png(results, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "decode_step.png"
    assert plot_e2e.main([str(results[0]), str(results[1]), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
