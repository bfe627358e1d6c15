"""The integration matrix runner (tools/matrix/run_matrix.py) without GPUs or frameworks:
selections, dry run, skip reasons, budget, reports, and the custom engine's cell on CPU."""

from __future__ import annotations

import json
import math

import pytest

from tools.matrix import run_matrix


@pytest.fixture(scope="module")
def m():
    return run_matrix


@pytest.fixture
def no_out(monkeypatch):
    monkeypatch.delenv("OUT", raising=False)


def test_smoke_covers_every_axis_value(m) -> None:
    smoke = m.select("smoke")
    assert 12 <= len(smoke) <= 24
    assert len({c.id for c in smoke}) == len(smoke)
    for axis, values in m.AXES.items():
        seen = {getattr(c, axis) for c in smoke}
        assert seen == set(values), f"smoke misses {axis} values {set(values) - seen}"
    # Every smoke cell is one its engine can run (a skip by design would not cover anything).
    assert [c.id for c in smoke if m.unsupported(c)] == []


def test_full_is_the_product(m) -> None:
    cells = m.select("full")
    assert len(cells) == math.prod(len(v) for v in m.AXES.values())
    assert len({c.id for c in cells}) == len(cells)
    assert set(m.select("smoke")) <= set(cells)


def test_filters(m) -> None:
    assert {c.engine for c in m.select("smoke", engines=["custom"])} == {"custom"}
    tp2 = m.select("full", cells=["-tp2"])
    assert tp2 and all(c.tp == 2 for c in tp2)
    both = m.select("smoke", engines=["vllm"], cells=["forest", "mixed"])
    assert {c.workload for c in both} == {"forest", "mixed"}


def test_dry_run(m, capsys) -> None:
    assert m.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    for c in m.select("smoke"):
        assert c.id in out
    assert "FLASH_ATTN" in out and "triton" in out and "dense" in out
    assert f"{len(m.SMOKE)} cells" in out
    assert m.main(["--dry-run", "--select", "full", "--cells", "custom-h32x8-d128-none"]) == 0
    out = capsys.readouterr().out
    assert "skip: the custom engine example has no CUDA graph mode" in out
    assert "skip: the custom engine example runs on one GPU" in out
    assert "skip: speculative decoding cells run on vLLM" in out
    assert "skip: a separate decode backend is SGLang's" in out
    assert "16 cells" in out  # graphs x tp x mode
    assert "skip: the custom engine example has no attention kernel of its own" in out


def test_unsupported(m) -> None:
    c = m.Cell
    assert m.unsupported(c("vllm", "32/8", 128, "none", "on", 2)) is None
    assert "head_dim 96" in m.unsupported(c("vllm", "32/8", 96, "none", "on", 1))
    assert "at most 16" in m.unsupported(c("sglang", "64/2", 128, "none", "on", 1))
    assert "tensor parallel size 2" in m.unsupported(c("vllm", "28/7", 128, "none", "on", 2))


def test_skip_reasons(m, monkeypatch) -> None:
    vllm_tp2 = m.Cell("vllm", "32/8", 128, "shared1", "on", 2)
    sglang = m.Cell("sglang", "32/8", 128, "shared1", "on", 1)
    monkeypatch.setattr(m, "probe_package", lambda name: None)
    assert "no GPU" in m.skip_reason(vllm_tp2, 0)
    assert m.skip_reason(vllm_tp2, 1) == "needs 2 GPUs, torch.cuda.device_count() == 1"
    assert m.skip_reason(vllm_tp2, 2) is None
    monkeypatch.setattr(
        m, "probe_package", lambda name: f"{name} not importable: x" if name == "sglang" else None
    )
    assert m.skip_reason(sglang, 1) == "sglang not importable: x"
    assert m.skip_reason(vllm_tp2, 2) is None


def run_main(m, monkeypatch, tmp_path, gpus, packages, *argv):
    """main() with probes replaced and cells faked as passing; returns the JSON report."""
    monkeypatch.setattr(m, "probe_gpus", lambda: gpus)
    monkeypatch.setattr(m, "probe_package", lambda name: packages.get(name))
    monkeypatch.setattr(m, "machine", lambda: "fake GPU")
    ran = []
    now = [0.0]
    monkeypatch.setattr(m, "clock", lambda: now[0])

    def fake_cell(cell, work, models, timeout):
        ran.append(cell.id)
        now[0] += 50.0  # each cell takes 50 s of the budget
        return {
            "status": "pass",
            "why": "",
            "max_logprob_diff": 0.01,
            "tokens": 10,
            "step_ms_backend": 1.0,
            "step_ms_default": 2.0,
            "speedup": 2.0,
        }

    monkeypatch.setattr(m, "run_cell", fake_cell)
    md, js = tmp_path / "m.md", tmp_path / "m.json"
    rc = m.main([*argv, "--out-md", str(md), "--out-json", str(js), "--work", str(tmp_path)])
    data = json.loads(js.read_text())
    assert md.read_text().count("\n| ") == len(data["cells"]) + 1  # header + one row per cell
    assert {r["cell"] for r in data["cells"]} - set(ran) == {
        r["cell"] for r in data["cells"] if r["status"] == "skip"
    }
    return rc, data


def test_run_without_gpu_skips_everything(m, monkeypatch, tmp_path, no_out) -> None:
    rc, data = run_main(m, monkeypatch, tmp_path, 0, {})
    assert rc == 0
    assert data["summary"]["skip"] == len(m.SMOKE)
    assert all("no GPU" in r["why"] for r in data["cells"])


def test_run_one_gpu_and_missing_package(m, monkeypatch, tmp_path, no_out) -> None:
    rc, data = run_main(
        m,
        monkeypatch,
        tmp_path,
        1,
        {"sglang": "sglang not importable: ModuleNotFoundError"},
        "--budget",
        "1e9",
    )
    rows = {r["cell"]: r for r in data["cells"]}
    for c in m.SMOKE:
        r = rows[c.id]
        if c.tp == 2:
            assert r["status"] == "skip" and "needs 2 GPUs" in r["why"]
        elif c.engine == "sglang":
            assert r["status"] == "skip" and "sglang not importable" in r["why"]
        else:
            assert r["status"] == "pass", r
    assert rc == 0


def test_budget_skips_the_rest(m, monkeypatch, tmp_path, no_out) -> None:
    # Custom cells are estimated at 60 s and take 50 s here: 150 s run two, not three.
    rc, data = run_main(m, monkeypatch, tmp_path, 2, {}, "--engines", "custom", "--budget", "150")
    statuses = [r["status"] for r in data["cells"]]
    assert statuses == ["pass", "pass"] + ["skip"] * (len(statuses) - 2)
    assert len(statuses) == len([c for c in m.SMOKE if c.engine == "custom"])
    assert all(r["why"].startswith("budget: 50 s of 150 s left") for r in data["cells"][2:])
    assert rc == 0


def test_markdown(m, tmp_path, no_out) -> None:
    base = {
        "engine": "vllm",
        "heads": "32/8",
        "head_dim": 128,
        "workload": "shared1",
        "graphs": "on",
        "tp": 1,
    }
    results = [
        {
            **base,
            "cell": "a",
            "status": "pass",
            "why": "",
            "max_logprob_diff": 0.0123,
            "tokens": 300,
            "step_ms_backend": 1.5,
            "step_ms_default": 3.0,
            "speedup": 2.0,
        },
        {
            **base,
            "cell": "b",
            "status": "fail",
            "why": "token mismatch | at 3",
            "max_logprob_diff": None,
        },
        {**base, "cell": "c", "status": "skip", "why": "no GPU"},
        {**base, "cell": "d", "status": "timeout", "why": "timeout after 9 s"},
    ]
    meta = {"select": "smoke", "machine": "1 x H200", "date": "today", "tol": 0.05}
    text = m.markdown(results, meta)
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert len(rows) == 5
    assert rows[1].split(" | ")[7:14] == ["plain", "pass", "0.0123", "300", "1.50", "3.00", "2.00"]
    assert rows[2].split(" | ")[8:10] == ["fail", "-"]
    assert "token mismatch / at 3" in rows[2] and rows[2].count("|") == rows[0].count("|")
    assert "**Summary: 4 cells: 1 pass, 1 fail, 1 timeout, 1 skip.**" in text
    md, js = tmp_path / "x" / "m.md", tmp_path / "y" / "m.json"
    m.write_reports(results, meta, md, js)
    assert md.read_text() == text
    assert json.loads(js.read_text())["summary"] == {"pass": 1, "fail": 1, "timeout": 1, "skip": 1}


def test_merge(m, tmp_path, no_out) -> None:
    cells = m.select("smoke")
    a, b = cells[0], cells[1]

    def row(cell, status, why=""):
        return {"cell": cell.id, **m.dataclasses.asdict(cell), "status": status, "why": why}

    def report(date, *rows):
        return {
            "select": "smoke",
            "machine": "1 x H200",
            "date": date,
            "tol": 0.05,
            "cells": list(rows),
        }

    first = report("d1", row(b, "pass"), row(a, "timeout", "slow"))
    second = report("d2", row(a, "pass"), row(b, "skip", "budget"))
    results, meta = m.merge_reports([first, second], {b.id: "seen in the log"})
    # Selection order; a later run wins, except that a skip never replaces a run.
    assert [r["cell"] for r in results] == [a.id, b.id]
    assert [r["status"] for r in results] == ["pass", "pass"]
    assert results[1]["why"] == "seen in the log"
    assert meta["runs"] == ["1 x H200, d1", "1 x H200, d2"]
    assert "merged from runs on 1 x H200, d1; 1 x H200, d2" in m.markdown(results, meta)
    with pytest.raises(SystemExit, match="no-such-cell"):
        m.merge_reports([first], {"no-such-cell": "x"})
    # The command line: reports in, one report out.
    paths = []
    for i, rep in enumerate((first, second)):
        paths.append(tmp_path / f"r{i}.json")
        paths[-1].write_text(json.dumps(rep))
    md, js = tmp_path / "m.md", tmp_path / "m.json"
    args = [
        "--merge",
        *map(str, paths),
        "--out-md",
        str(md),
        "--out-json",
        str(js),
        "--note",
        f"{a.id}=x=y",
    ]
    assert m.main(args) == 0
    out = json.loads(js.read_text())
    assert out["summary"]["pass"] == 2 and out["cells"][0]["why"] == "x=y"
    assert md.read_text().count(f"| {a.id} |") == 1
    # A merged report merges again with its runs kept; a note needs CELL=TEXT.
    assert m.merge_reports([out, second], {})[1]["runs"] == ["1 x H200, d1", "1 x H200, d2"]
    with pytest.raises(SystemExit):
        m.main(["--merge", str(paths[0]), "--note", "no-equals-sign"])


def test_workloads(m) -> None:
    for w in m.AXES["workload"]:
        req = m.make_requests(w)
        n = len(req["prompts"])
        assert 0 < n <= 32 and len(req["max_new"]) == n and len(req["arrival"]) == n
        assert all(
            0 < len(p) + k < 4096 for p, k in zip(req["prompts"], req["max_new"], strict=True)
        )
        assert all(0 <= t < m.VOCAB for p in req["prompts"] for t in p)
    par = m.make_requests("parallel")["prompts"]
    assert len({tuple(p) for p in par}) == 4 and all(par[i] == par[i - i % 4] for i in range(16))
    assert m.make_requests("mixed")["knobs"] == {"chunk": 256}
    assert m.make_requests("arrivals")["knobs"] == {"max_seqs": 8}
    assert m.make_requests("forest")["warm"] and not m.make_requests("none")["warm"]
    # Multi-turn: each turn's prompt extends the one before; turns 1 and 2 are cached first.
    turns = m.make_requests("multiturn")
    assert len(turns["prompts"]) == 12 and len(turns["warm"]) == 8
    for c in range(4):
        a, b, d = turns["prompts"][3 * c : 3 * c + 3]
        assert b[: len(a)] == a and d[: len(b)] == b and len(a) < len(b) < len(d)
        assert a[:300] == turns["prompts"][0][:300]  # one system prompt for all
    long = m.make_requests("longprompt")
    assert all(2500 <= len(p) <= 3000 for p in long["prompts"]) and long["max_new"] == [8] * 4
    low = m.make_requests("lowload")
    assert low["knobs"] == {"max_seqs": 1} and low["arrival"] == list(range(6))
    assert all(p[:600] == low["warm"][0] for p in low["prompts"][:4])


def test_serving_selection(m) -> None:
    cells = m.select("serving")
    # Each serving workload's twin, both engines, graphs on and off, the 8B heads.
    assert {c.workload for c in cells} == set(m.SERVING_WORKLOADS.values())
    assert set(m.SERVING_WORKLOADS) == {
        "forest", "multiturn", "parallel", "longprompt", "chat", "decode", "lowload"
    }  # fmt: skip
    assert len(cells) == 2 * 7 * 2 == len({c.id for c in cells})
    assert {(c.engine, c.graphs) for c in cells} == {
        (e, g) for e in ("vllm", "sglang") for g in ("on", "off")
    }
    assert all((c.heads, c.head_dim, c.tp, c.mode) == ("32/8", 128, 1, "plain") for c in cells)
    assert [c.id for c in cells if m.unsupported(c)] == []
    assert set(cells) <= set(m.full())


def test_delegate_selection(m) -> None:
    cells = m.select("delegate")
    assert all(c.mode == "delegate" and c.id.endswith("-tp1-delegate") for c in cells)
    assert {c.engine for c in cells} == {"vllm", "sglang"}
    assert {c.graphs for c in cells} == {"on", "off"}
    assert [c.id for c in cells if m.unsupported(c)] == []
    assert len({c.id for c in cells}) == len(cells) and set(cells) <= set(m.full())
    assert m.DELEGATE == {"delegate_unshared": True, "delegate_prefills": True}
    from prefixattn.engine.step import StepOptions

    StepOptions().updated(m.DELEGATE)  # names StepOptions knows


def test_modes(m) -> None:
    c = m.Cell
    plain = c("vllm", "32/8", 128, "shared1", "on", 1)
    spec = c("vllm", "32/8", 128, "shared1", "on", 1, "spec")
    hybrid = c("sglang", "32/8", 128, "shared1", "on", 1, "decode-only")
    # Ids of plain cells are those of reports written before the mode axis.
    assert plain.id == "vllm-h32x8-d128-shared1-gon-tp1" and plain.mode == "plain"
    assert spec.id == plain.id + "-spec" and hybrid.id.endswith("-tp1-decode-only")
    assert m.unsupported(spec) is None and m.unsupported(hybrid) is None
    assert "vLLM" in m.unsupported(c("sglang", "32/8", 128, "shared1", "on", 1, "spec"))
    assert "SGLang" in m.unsupported(c("vllm", "32/8", 128, "shared1", "on", 1, "decode-only"))
    assert "vLLM" in m.unsupported(c("custom", "32/8", 128, "shared1", "off", 1, "spec"))
    assert m.our_backend(spec) == "CUSTOM" and m.default_backend(spec) == "FLASH_ATTN"
    # The hybrid label is the one SGLang's engine check turns into backend arguments.
    args = m.sglang_check().backend_args(m.our_backend(hybrid))
    assert args == {
        "attention_backend": "triton",
        "prefill_attention_backend": "triton",
        "decode_attention_backend": "prefixattn",
    }
    assert m.sglang_check().backend_args(m.default_backend(hybrid)) == {
        "attention_backend": "triton"
    }
    # Speculative cells' prompts end with one of their own earlier 8-grams.
    for w in m.AXES["workload"]:
        base, echo = m.make_requests(w), m.make_requests(w, echo=True)
        assert echo["warm"] == base["warm"] and echo["max_new"] == base["max_new"]
        for p, q in zip(base["prompts"], echo["prompts"], strict=True):
            assert q[: len(p)] == p and len(q) == len(p) + 8
            tail = q[-8:]
            assert any(p[i : i + 8] == tail for i in range(len(p) - 7))


def test_judge_spec_needs_drafts(m, monkeypatch) -> None:
    cell = m.Cell("vllm", "32/8", 128, "shared1", "off", 1, "spec")
    outputs = [{"tokens": [1, 2], "logprobs": [[(1, -0.1), (5, -3.0)], [(2, -0.2), (7, -2.0)]]}]
    ref = {"outputs": outputs, "step_ms": 2.0}
    drafted = {"num_drafts": 3, "num_draft_tokens": 9, "num_accepted_tokens": 4}
    r = m.judge(cell, ref, {**ref, "info": {"spec_decode": drafted}})
    assert r["status"] == "pass" and r["spec_decode"] == drafted
    r = m.judge(cell, ref, {**ref, "info": {"spec_decode": {"num_draft_tokens": 0}}})
    assert r["status"] == "fail" and "drafted no tokens" in r["why"]
    r = m.judge(cell, ref, {**ref, "info": {}})
    assert r["status"] == "fail"


def test_judge_errors(m) -> None:
    cell = m.Cell("custom", "32/8", 128, "none", "off", 1)
    ok = {"outputs": [], "step_ms": 1.0}
    r = m.judge(cell, ok, {"error": "CUSTOM exited 1", "timed_out": False})
    assert r["status"] == "fail" and "exited 1" in r["why"]
    r = m.judge(cell, {"error": "timeout after 5 s", "timed_out": True}, ok)
    assert r["status"] == "timeout"


TINY = {"hidden": 64, "intermediate": 128, "layers": 2}
STD = 0.3  # a tiny model with std 0.02 has flat logits: every position a near tie


def tiny_requests(m):
    req = m.make_requests("forest")
    req["prompts"] = [p[:40] for p in req["prompts"][:6]]
    req["max_new"], req["arrival"] = [6] * 6, [0, 0, 1, 2, 2, 3]
    return req


def test_custom_cell_on_cpu(m) -> None:
    cell = m.Cell("custom", "4/2", 64, "forest", "off", 1)
    req = tiny_requests(m)
    ref = m.run_custom(cell, "dense", req, device="cpu", shape=TINY, block_size=4, init_std=STD)
    got = m.run_custom(
        cell, "prefixattn", req, device="cpu", shape=TINY, block_size=4, init_std=STD
    )
    assert [len(o["tokens"]) for o in got["outputs"]] == [6] * 6
    assert all(len(o["logprobs"]) == 6 for o in got["outputs"])
    r = m.judge(cell, ref, got)
    assert r["status"] == "pass", r
    assert r["tokens"] >= 18 and r["max_logprob_diff"] < 1e-3


@pytest.mark.parametrize("workload", ["multiturn", "lowload"])
def test_custom_cell_on_cpu_new_workloads(m, workload) -> None:
    # The workloads' own prompts (shorter outputs): multi-turn chains and batches of one.
    cell = m.Cell("custom", "4/2", 64, workload, "off", 1)
    req = m.make_requests(workload)
    req["max_new"] = [4] * len(req["prompts"])
    kw = {"device": "cpu", "shape": TINY, "block_size": 4, "init_std": STD}
    ref = m.run_custom(cell, "dense", req, **kw)
    got = m.run_custom(cell, "prefixattn", req, **kw)
    r = m.judge(cell, ref, got)
    assert r["status"] == "pass", r
    assert r["tokens"] >= len(req["prompts"]) and r["max_logprob_diff"] < 1e-3


def test_custom_cell_catches_wrong_attention(m, monkeypatch) -> None:
    cell = m.Cell("custom", "4/2", 64, "forest", "off", 1)
    req = tiny_requests(m)
    got = m.run_custom(
        cell, "prefixattn", req, device="cpu", shape=TINY, block_size=4, init_std=STD
    )
    run = m.DenseAttention.run
    monkeypatch.setattr(m.DenseAttention, "run", lambda self, q, k, v: run(self, q * 8, k, v))
    bad = m.run_custom(cell, "dense", req, device="cpu", shape=TINY, block_size=4, init_std=STD)
    assert m.judge(cell, bad, got)["status"] == "fail"


def test_model_config_fits_every_head_config(m) -> None:
    for heads in m.AXES["heads"]:
        for d in m.AXES["head_dim"]:
            cfg = m.model_config(m.Cell("vllm", heads, d, "none", "off", 1))
            assert cfg["hidden_size"] % cfg["num_attention_heads"] == 0
            assert cfg["hidden_size"] % 64 == 0 and cfg["hidden_size"] >= 1024
    assert m.hidden_size(28) == 1344 and m.hidden_size(32) == 1024


def test_model_is_written_before_the_engines_start(m, monkeypatch, tmp_path) -> None:
    calls: list[str] = []

    def fake(cell, backend, work, models, timeout):
        calls.append(backend)
        if backend == m.MAKE_MODEL and cell.workload == "forest":
            return {"error": "model exited 1 after 2.0 s", "timed_out": False}
        return {"outputs": [], "info": {}, "step_ms": 1.0}

    monkeypatch.setattr(m, "run_subprocess", fake)
    monkeypatch.setattr(m, "judge", lambda cell, ref, got: {"ref": ref, "got": got})
    m.run_cell(m.Cell("vllm", "28/4", 128, "none", "on", 1), tmp_path, tmp_path, 400)
    assert calls == [m.MAKE_MODEL, "FLASH_ATTN", "CUSTOM"]
    calls.clear()
    r = m.run_cell(m.Cell("sglang", "32/8", 128, "forest", "on", 1), tmp_path, tmp_path, 400)
    assert calls == [m.MAKE_MODEL] and "error" in r["ref"]
    calls.clear()
    m.run_cell(m.Cell("custom", "32/8", 128, "forest", "off", 1), tmp_path, tmp_path, 60)
    assert calls == ["dense", "prefixattn"]
