"""tools/trace_summary.py on a hand-made profiler trace."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from tools import trace_summary


@pytest.fixture(scope="module")
def ts():
    return trace_summary


def _ev(name: str, cat: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 1, "tid": 1}


TRACE = [
    # Two steps of GPU work with a 400 us idle gap between them, overlapping kernels in the
    # first step, and the host copy + plan of the second step inside the gap.
    _ev("fwd", "kernel", 0, 300),
    _ev("fwd2", "kernel", 100, 300),  # overlaps: busy 0-400
    _ev("copy", "gpu_memcpy", 410, 20),  # 10 us gap: below the threshold
    _ev("prefixattn.host_tables", "user_annotation", 450, 100),
    _ev("prefixattn.plan", "user_annotation", 560, 200),
    _ev("fwd", "kernel", 830, 170),  # gap 430-830 = 400 us
    _ev("cudaLaunchKernel", "cuda_runtime", 820, 5),
    {"ph": "i", "name": "marker", "ts": 5},
]


def test_summary_of_a_trace(ts, tmp_path: Path) -> None:
    path = tmp_path / "t.json.gz"
    path.write_bytes(gzip.compress(json.dumps({"traceEvents": TRACE}).encode()))
    s = ts.summarize(ts.load(path), gap_us=50)
    assert s["window_ms"] == 1.0
    assert s["gpu_busy_ms"] == pytest.approx(0.59)  # 400 + 20 + 170 us
    assert s["gpu_idle_ms"] == pytest.approx(0.41)
    assert s["gaps"]["count"] == 1 and s["gaps"]["total_ms"] == 0.4
    [gap] = s["gaps"]["longest"]
    assert gap["overlaps_ms"] == {"prefixattn.host_tables": 0.1, "prefixattn.plan": 0.2}
    assert s["ranges"]["prefixattn.plan"] == {"count": 1, "total_ms": 0.2, "mean_ms": 0.2}
    assert s["attention_ms"] == 0.0 and s["kernels_ms"] == {"fwd": 0.47, "fwd2": 0.3}
    attn = ts.summarize([*TRACE, _ev("void prefixattn::merge_kernel<bf16>", "kernel", 900, 50)])
    assert attn["attention_ms"] == 0.05


def test_trace_without_gpu_work(ts) -> None:
    s = ts.summarize([_ev("prefixattn.plan", "user_annotation", 0, 10)])
    assert s["window_ms"] == 0.0 and s["ranges"]["prefixattn.plan"]["count"] == 1


def test_cli(ts, tmp_path: Path, capsys) -> None:
    path = tmp_path / "t.json"
    path.write_text(json.dumps(TRACE))  # a bare event list is accepted too
    assert ts.main([str(path), "--gap-us", "5"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out[str(path)]["gaps"]["count"] == 2  # the 10 us gap counts at 5 us


def test_steps(ts) -> None:
    # Three steps of 1000 us marked by "step"; each has 600 us of GPU work and a 400 us gap
    # during which the host waits in a sync; a fourth, long interval is not a steady step.
    ev = []
    for i, start in enumerate((0, 1000, 2000, 3000)):
        ev.append(_ev("step", "user_annotation", start, 10))
        ev.append(_ev("fwd", "kernel", start + 400, 600))
        if i < 3:
            ev.append(_ev("cudaStreamSynchronize", "cuda_runtime", start + 50, 300))
    ev.append(_ev("step", "user_annotation", 9000, 10))
    s = ts.steps_summary(ev, "step", gap_us=50)
    assert s["count"] == 3 and s["all_ms"] == [1.0, 1.0, 1.0, 6.0]
    assert s["step_ms"] == 1.0 and s["gpu_busy_ms"] == 0.6 and s["gpu_idle_ms"] == 0.4
    host = s["host_during_idle_ms_per_step"]
    assert host["cuda_runtime/cudaStreamSynchronize"] == 0.3
    assert host["user_annotation/step"] == 0.01
    assert s["kernels_ms_per_step"] == {"fwd": 0.6}
    assert ts.steps_summary(ev, "missing") == {"marker": "missing", "count": 0}


def test_attention_share_of_steps(ts, tmp_path: Path) -> None:
    # Two steps of 1000 us: an attention kernel of each family in one, a GEMM in both.
    ev = []
    for start, attn in (
        (0, "void prefixattn::forward_leaf_kernel<__nv_bfloat16, 128, 3>"),
        (1000, "void flashinfer::BatchPrefillWithPagedKVCacheKernel<...>"),
    ):
        ev.append(_ev("cudaGraphLaunch", "cuda_runtime", start, 5))
        ev.append(_ev(attn, "kernel", start + 10, 300))
        ev.append(_ev("nvjet_sm90_tst_256x128", "kernel", start + 320, 500))
    ev.append(_ev("cudaGraphLaunch", "cuda_runtime", 2000, 5))
    s = ts.steps_summary(ev, "cudaGraphLaunch")
    assert s["step_ms"] == 1.0
    assert s["attention_ms_per_step"] == 0.3 and s["rest_ms_per_step"] == 0.7
    assert not ts.is_attention("nvjet_sm90_tst_256x128")
    assert ts.is_attention("void prefixattn::forward_kernel<__nv_bfloat16, 256, 4>(...)")
    path = tmp_path / "run" / "t.json"
    path.parent.mkdir()
    path.write_text(json.dumps(ev))
    [summary] = ts.summarize_traces(tmp_path, step_marker="cudaGraphLaunch").values()
    assert summary["steps"]["attention_ms_per_step"] == 0.3


def test_cut_off_trace_is_an_error_entry(ts, tmp_path: Path) -> None:
    """A trace whose writer was stopped part-way (a worker out of time) is reported, not
    raised: the serving benchmark summarises every backend's traces after it exits."""
    whole = gzip.compress(json.dumps({"traceEvents": TRACE}).encode())
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "cut.json.gz").write_bytes(whole[: len(whole) // 2])
    (tmp_path / "a" / "ok.json.gz").write_bytes(whole)
    with pytest.raises(ValueError, match=r"cut\.json\.gz: not a complete trace"):
        ts.load(tmp_path / "a" / "cut.json.gz")
    # A corrupted stream (bytes flipped inside the deflate data), not only a cut-off one.
    bad = bytearray(whole)
    bad[20:40] = bytes(b ^ 0xFF for b in bad[20:40])
    (tmp_path / "a" / "bad.json.gz").write_bytes(bytes(bad))
    out = ts.summarize_traces(tmp_path)
    assert "not a complete trace" in out["a/cut.json.gz"]["error"]
    assert "not a complete trace" in out["a/bad.json.gz"]["error"]
    assert out["a/ok.json.gz"]["gpu_busy_ms"] == pytest.approx(0.59)


def _launch(name: str, ts: float, corr: int) -> dict:
    return {**_ev(name, "cuda_runtime", ts, 5), "args": {"correlation": corr}}


def _kernel(name: str, ts: float, dur: float, corr: int) -> dict:
    return {**_ev(name, "kernel", ts, dur), "args": {"correlation": corr}}


def test_step_kinds_split_steps_by_graph_launches_and_own_their_kernels(ts) -> None:
    # Three steps starting at 0, 1000 and 2000 (the marker at 3000 closes the third): one
    # whole-step graph, one piecewise step (two graph launches around an eager attention
    # kernel), one eager step. The first step's graph runs on the GPU after the second step's
    # marker: its kernels still belong to the first step, whose host span launched them.
    trace = [
        _ev("step", "user_annotation", 0, 50),
        _ev("step", "user_annotation", 1000, 50),
        _ev("step", "user_annotation", 2000, 50),
        _ev("step", "user_annotation", 3000, 50),
        _launch("cudaGraphLaunch", 100, 1),
        _kernel("prefixattn::forward_leaf_kernel", 1100, 40, 1),
        _kernel("gemm", 1150, 60, 1),
        _launch("cudaGraphLaunch", 1100, 2),
        _launch("cudaLaunchKernel", 1200, 3),
        _launch("cudaGraphLaunch", 1300, 4),
        _kernel("gemm", 1400, 30, 2),
        _kernel("flash_fwd_kernel", 1450, 20, 3),
        _kernel("gemm", 1500, 30, 4),
        _launch("cudaLaunchKernel", 2100, 5),
        _kernel("_fwd_kernel_stage1", 2200, 70, 5),
        _kernel("orphan", 2300, 10, 99),  # no launch in the trace: no step
    ]
    s = ts.step_kinds(trace, "step")
    assert s["steps"] == 3 and s["window_ms"] == 3.0
    graph, piecewise, eager = (s["kinds"][k] for k in ("graph", "piecewise", "eager"))
    assert graph == {
        "steps": 1,
        "graph_launches": 1,
        "host_ms": 1.0,
        "median_ms": 1.0,
        "attention_ms": 0.04,
        "other_kernels_ms": 0.06,
        "planning_ms": 0.0,
    }
    assert piecewise["steps"] == 1 and piecewise["attention_ms"] == 0.02
    assert piecewise["graph_launches"] == 2 and eager["graph_launches"] == 0
    assert piecewise["other_kernels_ms"] == 0.06
    assert eager["attention_ms"] == 0.07 and eager["other_kernels_ms"] == 0.0
    assert sum(k["host_ms"] for k in s["kinds"].values()) == s["window_ms"]
    assert ts.step_kinds(trace, "absent") == {"marker": "absent", "steps": 0, "kinds": {}}


def test_step_kinds_read_vllms_step_ranges(ts) -> None:
    """vLLM names each profiled step by its prefill chunks and decodes: the kinds are what
    the steps ran, and the GPU's copy of the range (gpu_user_annotation) is not a step."""
    names = [
        "execute_context_2(700)_generation_254(254)",
        "execute_context_0(0)_generation_256(256)",
        "execute_context_0(0)_generation_256(256)",
        "execute_context_3(16384)_generation_0(0)",
        "execute_context_0(0)_generation_255(255)",
    ]
    trace = [_ev(n, "user_annotation", 1000 * i, 50) for i, n in enumerate(names)]
    trace += [_ev(n, "gpu_user_annotation", 1000 * i + 300, 500) for i, n in enumerate(names)]
    trace += [_launch("cudaGraphLaunch", 1100, 1), _launch("cudaGraphLaunch", 2100, 2)]
    # Plans on the host in the first three steps; their GPU-side copies are not host time.
    trace += [_ev("prefixattn.plan", "user_annotation", 1000 * i + 60, 100 * (i + 1))
              for i in range(3)]  # fmt: skip
    trace += [_ev("prefixattn.plan", "gpu_user_annotation", 1000 * i + 400, 900)
              for i in range(3)]  # fmt: skip
    s = ts.step_kinds(trace, "execute_context_")
    assert s["steps"] == 4 and s["window_ms"] == 4.0
    assert s["kinds"]["decode"] == {
        "steps": 2,
        "graph_launches": 2,
        "host_ms": 2.0,
        "median_ms": 1.0,
        "attention_ms": 0.0,
        "other_kernels_ms": 0.0,
        "planning_ms": 0.5,
        "prefill_tokens": 0,
        "decodes": 512,
    }
    assert s["kinds"]["mixed"]["prefill_tokens"] == 700 and s["kinds"]["mixed"]["decodes"] == 254
    assert s["kinds"]["mixed"]["planning_ms"] == 0.1
    assert ts.summarize(trace)["ranges"]["prefixattn.plan"] == {
        "count": 3, "total_ms": 0.6, "mean_ms": 0.2}  # fmt: skip
    assert s["kinds"]["prefill"]["steps"] == 1 and s["kinds"]["prefill"]["decodes"] == 0
    assert ts.steps_summary(trace, "execute_context_")["count"] == 4


def test_steps_summary_of_a_long_trace(ts) -> None:
    """A serving run's trace: 2,000 steps, each with 100 kernels and 100 host events (the
    summary is linear in the events; a quadratic one took minutes on such traces)."""
    trace = []
    for step in range(2000):
        t = step * 10_000.0
        trace.append(_ev("step", "user_annotation", t, 10))
        for k in range(100):
            trace.append(_ev("gemm", "kernel", t + 2000 + k * 60, 50))
            trace.append(_ev("cudaLaunchKernel", "cuda_runtime", t + k * 90, 5))
    s = ts.steps_summary(trace, "step")
    assert s["count"] == 1999 and s["gpu_busy_ms"] == 5.0  # 100 kernels of 50 us a step
    # The idle gaps: 2,000 us before each step's kernels and 2,010 after them; 23 launches
    # of 5 us fall in the first, 11 in the second.
    assert s["gpu_idle_ms"] == 5.0
    assert s["host_during_idle_ms_per_step"]["cuda_runtime/cudaLaunchKernel"] == 0.17


def test_slim_copy_summarizes_the_same(ts, tmp_path: Path) -> None:
    """The slim copy keeps what the summaries read: the same summary, steps and kinds,
    without the per-operator events."""
    trace = [
        _ev("step", "user_annotation", 0, 50),
        _ev("step", "user_annotation", 1000, 50),
        _ev("step", "user_annotation", 2000, 50),
        {**_ev("aten::mm", "cpu_op", 10, 80), "args": {"Input Dims": [[4, 4]]}},
        _launch("cudaGraphLaunch", 100, 1),
        _kernel("prefixattn::forward_leaf_kernel", 300, 40, 1),
        _launch("cudaLaunchKernel", 1100, 2),
        _kernel("gemm", 1300, 60, 2),
    ]
    path = tmp_path / "run.pt.trace.json.gz"
    path.write_bytes(gzip.compress(json.dumps({"traceEvents": trace}).encode()))
    assert ts.main([str(path), "--step-marker", "step", "--slim", str(tmp_path / "s")]) == 0
    copy = tmp_path / "s" / "run.pt.trace.slim.json.gz"
    slimmed = ts.load(copy)
    assert len(slimmed) == len(trace) - 1 and all(e["cat"] != "cpu_op" for e in slimmed)
    full = ts.load(path)
    assert ts.summarize(slimmed) == ts.summarize(full)
    assert ts.step_kinds(slimmed, "step") == ts.step_kinds(full, "step")
    assert ts.steps_summary(slimmed, "step")["gpu_busy_ms"] == ts.steps_summary(
        full, "step")["gpu_busy_ms"]  # fmt: skip
