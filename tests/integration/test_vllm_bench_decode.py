"""tools/vllm/bench_decode.py's parent without vLLM: an engine that overruns its time
after its last measurement still counts as complete; one cut off earlier does not."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tools.vllm import bench_decode


@pytest.fixture(scope="module")
def bd():
    return bench_decode


def _run(bd, monkeypatch, tmp_path, outcomes):
    """Run main() with fake workers: ``outcomes[backend] = (exit code, finished)``."""

    def fake_run(cmd, timeout):
        backend = cmd[cmd.index("--worker") + 1]
        code, finished = outcomes[backend]
        data = {"step_ms": {"none": {"256": 10.0}}, "info": {}}
        if finished:
            data["info_after"] = {}
        Path(cmd[cmd.index("--result") + 1]).write_text(json.dumps(data))
        return code

    out = tmp_path / "out.json"
    monkeypatch.setattr(bd, "write_model", lambda path, max_len: None)
    monkeypatch.setattr(bd, "run_in_group", fake_run)
    argv = ["bench_decode.py", "--out", str(out), "--workloads", "none", "--backends", *outcomes]
    monkeypatch.setattr(sys, "argv", argv)
    code = bd.main()
    return code, json.loads(out.read_text())


def test_shutdown_overrun_after_the_last_measurement_is_complete(bd, monkeypatch, tmp_path):
    outcomes = {"CUSTOM": (0, True), "FLASHINFER": ("timeout after 86 s", True)}
    code, res = _run(bd, monkeypatch, tmp_path, outcomes)
    assert code == 0
    assert res["engine"]["FLASHINFER"]["finished"] is True
    assert res["speedup_vs"]["FLASHINFER"]["none"]["256"] == 1.0


def test_cut_off_before_the_end_is_incomplete(bd, monkeypatch, tmp_path):
    outcomes = {"CUSTOM": (0, True), "FLASHINFER": ("timeout after 86 s", False)}
    code, res = _run(bd, monkeypatch, tmp_path, outcomes)
    assert code == 1
    assert res["engine"]["FLASHINFER"]["finished"] is False
