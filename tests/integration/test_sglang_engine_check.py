"""tools/sglang/engine_check.py's parent without SGLang: ``--decode-only`` starts the
checked engine with the reference backend for prefill and prefixattn for decode, and judges
that engine's decode steps."""

from __future__ import annotations

import json
import sys

import pytest

from tools.sglang import engine_check


@pytest.fixture(scope="module")
def ec():
    return engine_check


def test_backend_args(ec) -> None:
    assert ec.backend_args("prefixattn") == {"attention_backend": "prefixattn"}
    assert ec.backend_args("triton-prefill-prefixattn-decode") == {
        "attention_backend": "triton",
        "prefill_attention_backend": "triton",
        "decode_attention_backend": "prefixattn",
    }


def _main(ec, monkeypatch, tmp_path, candidate_graph_steps: int):
    """main() with --decode-only and fake engines that agree on every token."""
    started = []

    def fake_run(cmd, timeout, log):
        backend, mode = cmd[cmd.index("--one") + 1 : cmd.index("--one") + 3]
        started.append(backend)
        graphs = candidate_graph_steps if backend != "triton" else 3
        log.write_text(
            "".join(f"Decode batch, #running-req: 4, cuda graph: {i < graphs}\n" for i in range(3))
        )
        out = [{"tokens": [7], "logprobs": [-1.0], "top2": [[-1.0, -2.0]], "cached_tokens": 9}]
        data = {"outputs": out, "start_s": 1.0, "server": {}}
        (tmp_path / f"sglang_check_{backend}_{mode}.json").write_text(json.dumps(data))
        return 0

    monkeypatch.setattr(ec, "run_in_group", fake_run)
    argv = [
        "engine_check.py",
        "--out",
        str(tmp_path),
        "--model",
        str(tmp_path / "m"),
        "--graph-modes",
        "on",
        "--decode-only",
    ]
    monkeypatch.setattr(sys, "argv", argv)
    code = ec.main()
    summary = json.loads((tmp_path / "sglang_engine_check.json").read_text())
    return code, started, summary


def test_decode_only_runs_the_hybrid_engine(ec, monkeypatch, tmp_path) -> None:
    code, started, summary = _main(ec, monkeypatch, tmp_path, candidate_graph_steps=3)
    assert started == ["triton", "triton-prefill-prefixattn-decode"]
    assert code == 0 and summary["decode_only_graphs_on"]["ok"]


def test_decode_only_fails_without_graph_steps(ec, monkeypatch, tmp_path) -> None:
    code, _, summary = _main(ec, monkeypatch, tmp_path, candidate_graph_steps=1)
    assert code == 1 and not summary["decode_only_graphs_on"]["ok"]
    assert "CUDA graphs" in summary["decode_only_graphs_on"]["why"]
