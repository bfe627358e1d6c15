"""tools/vllm/check_engine.py's parent without vLLM: the speculative-decoding mode's
prompts give an n-gram proposer a match, its counters are read from vLLM's metrics, and the
mode fails when CUSTOM's engine drafted nothing (so no query longer than one token ran)."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

import pytest

from tools.vllm import check_engine


@pytest.fixture(scope="module")
def ce():
    return check_engine


def test_echo_prompts_end_with_an_earlier_ngram(ce) -> None:
    plain, echo = ce.prompts(), ce.prompts(echo=True)
    assert len(plain) == len(echo) == 25
    for p in echo[:24]:
        tail = p[-8:]
        earlier = p[:-8]
        assert any(earlier[i : i + 8] == tail for i in range(len(earlier) - 7))
    # The forest is kept: leaves under one child share its 1000 tokens.
    assert echo[0][:1000] == echo[3][:1000]
    assert echo[0][:700] == echo[4][:700] and echo[0][700:1000] != echo[4][700:1000]


@dataclass
class _Counter:
    name: str
    value: int


@dataclass
class _Vector:
    name: str
    values: list[int]


def test_spec_counts_sums_counters(ce) -> None:
    class Llm:
        def get_metrics(self):
            return [
                _Counter("vllm:spec_decode_num_drafts", 5),
                _Counter("vllm:spec_decode_num_draft_tokens", 12),
                _Counter("vllm:spec_decode_num_draft_tokens", 3),  # a second label set
                _Counter("vllm:spec_decode_num_accepted_tokens", 4),
                _Vector("vllm:spec_decode_num_accepted_tokens_per_pos", [3, 1, 0]),
                _Counter("vllm:num_preemptions", 7),
            ]

    assert ce.spec_counts(Llm()) == {
        "num_drafts": 5,
        "num_draft_tokens": 15,
        "num_accepted_tokens": 4,
    }


def _main(ce, monkeypatch, tmp_path, drafted: int):
    """main() for mode ``spec`` with fake engines that agree on every token."""
    outputs = [{"tokens": [5, 6], "logprobs": [[[5, -1.0], [9, -2.0]], [[6, -1.0], [9, -3.0]]]}]

    def fake_run(cmd, timeout):
        backend, mode = cmd[cmd.index("--one") + 1 : cmd.index("--one") + 3]
        info = {"spec_decode": {"num_draft_tokens": drafted if backend == "CUSTOM" else 9}}
        path = tmp_path / f"vllm_check_{backend}_{mode}.json"
        path.write_text(json.dumps({"outputs": outputs, "info": info}))
        return 0

    monkeypatch.setattr(ce, "save_model", lambda path: None)
    monkeypatch.setattr(ce, "run_in_group", fake_run)
    monkeypatch.setattr(sys, "argv", ["check_engine.py", "--out", str(tmp_path), "--modes", "spec"])
    try:
        ce.main()
        ok = True
    except AssertionError:
        ok = False
    return ok, json.loads((tmp_path / "vllm_check_engine.json").read_text())["spec"]


def test_spec_mode_needs_drafts(ce, monkeypatch, tmp_path) -> None:
    ok, result = _main(ce, monkeypatch, tmp_path, drafted=0)
    assert not ok and not result["ok"]
    assert "drafted no tokens" in result["why"]


def test_spec_mode_passes_with_drafts(ce, monkeypatch, tmp_path) -> None:
    ok, result = _main(ce, monkeypatch, tmp_path, drafted=6)
    assert ok and result["ok"]
    assert result["custom_spec_decode"] == {"num_draft_tokens": 6}
    assert result["tokens"] == 2


def test_full_decode_graphs_counts_graphs_given_to_flash_attn(ce) -> None:
    """A builder whose graphs all hold FLASH_ATTN's kernels (one request at a time under
    ``delegate_unshared``) still ran full decode graphs; one that captured none did not, nor
    one with larger graphs that prefixattn never captured."""

    def info(
        captured: int | None, delegated: int, mode: str = "FULL_AND_PIECEWISE", tokens: int = 1
    ) -> dict:
        builder = {"builder": "PrefixAttentionMetadataBuilder", "full_graphs": True,
                   "captured_generation": captured, "delegated_captures": delegated,
                   "max_graph_tokens": tokens}  # fmt: skip
        return {"cudagraph_mode": mode, "builders": [builder]}

    assert ce.full_decode_graphs(info(3, 0, tokens=64))
    assert ce.full_decode_graphs(info(None, 1))
    assert ce.full_decode_graphs(info(3, 2, tokens=64))
    assert not ce.full_decode_graphs(info(None, 1, tokens=64))
    assert not ce.full_decode_graphs(info(None, 0))
    assert not ce.full_decode_graphs(info(None, 1, mode="PIECEWISE"))
    old = info(None, 0)
    del old["builders"][0]["delegated_captures"]  # a result from before the field
    assert not ce.full_decode_graphs(old)
