"""integration/plot_e2e.py on the stored end-to-end results."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import INTEGRATION, load_script

E2E = Path(__file__).resolve().parents[2] / "docs" / "results" / "e2e"
VLLM, SGLANG = E2E / "vllm_bench_decode_run3.json", E2E / "sglang_bench_decode.json"


@pytest.fixture(scope="module")
def pe():
    return load_script("plot_e2e", INTEGRATION / "plot_e2e.py")


def test_table_reads_both_result_formats(pe) -> None:
    table = pe.decode_table(VLLM, SGLANG)
    vllm, sgl = table["vLLM 0.26.0"], table["SGLang 0.5.17"]
    assert set(vllm) == {"shared1", "tree", "none"}
    assert set(vllm["shared1"]) == {"CUSTOM", "FLASH_ATTN", "FLASHINFER"}
    assert vllm["shared1"]["CUSTOM"] == 11.804
    assert set(sgl) == {"shared1:1024", "shared1:4096", "shared3:4096", "none:1024"}
    assert sgl["shared1:4096"] == {"prefixattn": 13.785, "flashinfer": 24.707, "triton": 41.661}


def test_plot_writes_a_png(pe, tmp_path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "decode_step.png"
    assert pe.main([str(VLLM), str(SGLANG), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
