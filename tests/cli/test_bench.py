"""The benchmark's FlashInfer cascade input describes the same attention (CPU check)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from prefixattn import PrefixAttention, attention_reference, tree_batch
from prefixattn.bench import cascade_levels


def _cascade_attention(q, k, v, levels, page_size):
    """What FlashInfer's cascade computes: attention of each level's query segments over the
    segment's pages, merged across levels by log-sum-exp (q in the levels' request order)."""
    t, hq, d = q.shape
    g = hq // k.shape[2]
    acc = torch.zeros(t, hq, d, dtype=torch.float64)
    lse = torch.full((t, hq), -math.inf, dtype=torch.float64)
    for qo, kv_indptr, indices, last in levels:
        for s in range(len(qo) - 1):
            pages = torch.from_numpy(indices[kv_indptr[s] : kv_indptr[s + 1]].astype(np.int64))
            n = (len(pages) - 1) * page_size + int(last[s])
            ks = k[pages].reshape(-1, k.shape[2], d)[:n].double().repeat_interleave(g, dim=1)
            vs = v[pages].reshape(-1, v.shape[2], d)[:n].double().repeat_interleave(g, dim=1)
            qs = q[qo[s] : qo[s + 1]].double()
            logits = torch.einsum("thd,nhd->thn", qs, ks) / math.sqrt(d)
            seg_lse = torch.logsumexp(logits, dim=-1)
            seg_out = torch.einsum("thn,nhd->thd", torch.softmax(logits, dim=-1), vs)
            new_lse = torch.logaddexp(lse[qo[s] : qo[s + 1]], seg_lse)
            old_w = torch.exp(lse[qo[s] : qo[s + 1]] - new_lse).unsqueeze(-1)
            acc[qo[s] : qo[s + 1]] = acc[qo[s] : qo[s + 1]] * old_w + seg_out * torch.exp(
                seg_lse - new_lse
            ).unsqueeze(-1)
            lse[qo[s] : qo[s + 1]] = new_lse
    return acc


@pytest.mark.parametrize(
    "spec, page_size",
    [
        ("1,10_64,17", 4),
        ("1,4,16_40,24,9", 8),
        ("2,8_32,5", 1),
        ("8_33", 16),
        ("1,2,4,8_16,16,16,3", 4),
    ],
)
def test_cascade_levels_compute_plain_attention(spec: str, page_size: int) -> None:
    table, lens = tree_batch(spec, page_size, seed=3)
    plan = PrefixAttention(8, 2, 64, page_size).plan(table, lens)
    levels = cascade_levels(plan.forest, table, lens, page_size)
    gen = torch.Generator().manual_seed(0)
    pages = int(table.max()) + 1
    k = torch.randn(pages, page_size, 2, 16, generator=gen)
    v = torch.randn(pages, page_size, 2, 16, generator=gen)
    q = torch.randn(len(lens), 8, 16, generator=gen)
    order = torch.from_numpy(plan.forest.order.astype(np.int64))
    got = torch.empty(q.shape, dtype=torch.float64)
    got[order] = _cascade_attention(q[order], k, v, levels, page_size)
    want = attention_reference(
        q.double(), k.double(), v.double(), torch.from_numpy(table), torch.from_numpy(lens)
    )
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    assert len(levels) == int(plan.forest.depth().max()) + 1


def test_cascade_levels_refuse_uneven_trees() -> None:
    # One request ends in the shared root while others go on: no uniform cascade.
    table = np.array([[1, 2, 3], [1, 2, 4], [1, 2, 0]], dtype=np.int32)
    lens = np.array([6, 6, 4], dtype=np.int32)
    plan = PrefixAttention(8, 2, 64, 2).plan(table, lens)
    with pytest.raises(ValueError, match=r"inside a shared node|different depths"):
        cascade_levels(plan.forest, table, lens, 2)


def test_cascade_levels_refuse_a_leaf_of_different_lengths() -> None:
    # Two requests on the same pages but of lengths 6 and 5: one segment cannot hold both.
    table = np.array([[1, 2, 3], [1, 2, 3], [1, 2, 4]], dtype=np.int32)
    lens = np.array([6, 5, 6], dtype=np.int32)
    plan = PrefixAttention(8, 2, 64, 2).plan(table, lens)
    with pytest.raises(ValueError, match="different lengths"):
        cascade_levels(plan.forest, table, lens, 2)


def test_timer_warms_up_before_timing() -> None:
    """Each timed function gets untimed calls first (at least WARMUP_CALLS, for at least
    WARMUP_S), each after an L2 flush, then exactly ``iters`` timed calls."""
    from types import SimpleNamespace

    from prefixattn.bench import _Timer

    log: list[str] = []

    class Event:
        def __init__(self, enable_timing: bool = False) -> None:
            self.t = 0.0

        def record(self) -> None:
            self.t = float(len(log))

        def synchronize(self) -> None:
            pass

        def elapsed_time(self, other: Event) -> float:
            return other.t - self.t

    spins: list[int] = []
    buf = SimpleNamespace(zero_=lambda: log.append("flush"))
    fake = SimpleNamespace(
        empty=lambda *a, **k: buf,
        uint8=None,
        cuda=SimpleNamespace(synchronize=lambda: None, Event=Event, _sleep=spins.append),
    )
    timer = _Timer(fake, iters=5)
    timer.median_us(lambda: log.append("call"))
    calls = [i for i, x in enumerate(log) if x == "call"]
    assert len(calls) >= 5 + _Timer.WARMUP_CALLS
    assert all(log[i - 1] == "flush" for i in calls)
    # Every timed call (not the warm-up ones) follows a GPU spin that covers its launches.
    assert spins == [_Timer.SPIN_CYCLES] * 5
    spins.clear()

    # Interleaved: every function warmed up, then rounds with a rotating start; a function
    # that fails is reported and not timed.
    log.clear()

    def fail() -> None:
        raise RuntimeError("unsupported here")

    fns = {n: (lambda n=n: log.append(n)) for n in "abc"}
    times, errors = timer.interleaved_us({**fns, "x": fail})
    assert errors == {"x": "unsupported here"} and set(times) == set("abc")
    timed = [x for x in log if x != "flush"]
    warm = len(timed) - 3 * 5
    assert warm >= 3 * _Timer.WARMUP_CALLS
    rounds = [timed[warm + 3 * i : warm + 3 * i + 3] for i in range(5)]
    assert rounds == [list("abc"), list("bca"), list("cab"), list("abc"), list("bca")]
    # The fake clock: one log entry (the call itself) between the two events = 1 ms.
    assert all(t == 1e3 for t in times.values())


def test_bench_plan_script_runs() -> None:
    """benchmarks/bench_plan.py (cited in docs/performance.md) runs all of its planners."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_plan.py"
    args = ["--tree", "1,4_64,16", "--repeat", "1", "--page-sizes", "16"]
    run = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "plan() native" in run.stdout


def test_kernel_breakdown() -> None:
    """Per-call kernel times from trace events; other kernels (the flush) separate calls."""
    from prefixattn.bench import kernel_breakdown

    fwd = "void prefixattn::forward_mma_kernel<__nv_bfloat16, 128, 4, 2, 3>(prefixattn::ForwardParams)"
    merge = "void prefixattn::merge_kernel<__nv_bfloat16, 128>(prefixattn::MergeParams)"
    flush = "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<unsigned char>>()"
    events = [
        {"name": flush, "ts": 0, "dur": 50},
        {"name": fwd, "ts": 60, "dur": 20},
        {"name": fwd, "ts": 70, "dur": 20},  # overlaps the first (concurrent groups)
        {"name": merge, "ts": 100, "dur": 5},
        {"name": flush, "ts": 200, "dur": 50},
        {"name": fwd, "ts": 260, "dur": 30},
        {"name": merge, "ts": 300, "dur": 10},
    ]
    bd = kernel_breakdown(events)
    assert bd["calls"] == 2
    assert bd["span_us"] == (45 + 50) / 2  # 60..105 and 260..310
    assert bd["busy_us"] == (35 + 40) / 2  # 60..90 + 100..105; 260..290 + 300..310
    assert bd["kernels"] == {
        "forward_mma_kernel<__nv_bfloat16, 128, 4, 2, 3>": {"per_call": 1.5, "us": 35.0},
        "merge_kernel<__nv_bfloat16, 128>": {"per_call": 1.0, "us": 7.5},
    }
    assert kernel_breakdown([{"name": flush, "ts": 0, "dur": 1}]) == {"calls": 0}


def test_compare_builds(tmp_path) -> None:
    """benchmarks/compare_builds.py: runs of a side averaged per configuration; geomeans."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location(
        "compare_builds", Path(__file__).resolve().parents[2] / "benchmarks" / "compare_builds.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def report(name: str, times: list[float], fi: float) -> str:
        rows = [
            {
                "tree": t,
                "heads": [32, 8],
                "page_size": 16,
                "floor_us": 10.0,
                "prefixattn_us": us,
                "fi_decode_us": fi,
            }
            for t, us in zip(["a", "b"], times, strict=True)
        ]
        path = tmp_path / name
        path.write_text(json.dumps({"rows": rows}))
        return str(path)

    base = [report("b1.json", [20.0, 40.0], 50.0), report("b2.json", [20.0, 40.0], 50.0)]
    new = [report("n1.json", [10.0, 40.0], 55.0), report("n2.json", [10.0, 40.0], 55.0)]
    result = mod.compare(base, new)
    assert [r["new_over_base"] for r in result["rows"]] == [0.5, 1.0]
    assert abs(result["geomean_new_over_base"] - 0.5**0.5) < 1e-12
    assert abs(result["geomean_fi_decode_drift"] - 1.1) < 1e-12
    assert abs(result["geomean_pct_floor_base"] - 100 * (0.5 * 0.25) ** 0.5) < 1e-9
    assert "| a | 32,8 | 16 |" in mod.to_markdown(result)


def test_ablations_are_valid_options() -> None:
    """Every ablation builds its options and tile table; none sets an environment variable."""
    import dataclasses

    from prefixattn import LaunchOptions, PlanOptions
    from prefixattn.bench import ABLATIONS, MAIN

    assert MAIN.plan == {} and MAIN.launch == {} and MAIN.tiles == ""
    pa = PrefixAttention(32, 8, 128, 16)
    for name, variant in ABLATIONS.items():
        PlanOptions(**variant.plan)
        LaunchOptions(**variant.launch)
        table = variant.tile_table(pa.tiles)
        assert (table == pa.tiles) == (variant.tiles == ""), name
        assert variant.packing in ("memory", "naive", "per_query"), name
    assert ABLATIONS["one_tile"].tile_table(pa.tiles).m_sizes == (128,)
    assert dataclasses.replace(pa.tiles, wide_kv_len=0) == ABLATIONS["no_wide"].tile_table(pa.tiles)


def test_bench_arguments_are_checked(capsys: pytest.CaptureFixture[str]) -> None:
    from prefixattn.bench import _parse

    args = _parse(["--heads", "32/8", "16,4", "--trees", "1,4_64,16"])
    assert args.heads == [(32, 8), (16, 4)] and args.trees == ["1,4_64,16"]
    for bad in (
        ["--heads", "32"],
        ["--trees", "1,2"],
        ["--head-dim", "96"],
        ["--page-size", "0"],
        ["--ablations", "tile16"],
        ["--iters", "0"],
    ):
        with pytest.raises(SystemExit) as exit_info:
            _parse(bad)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("prefixattn bench: error:"), err
    with pytest.raises(SystemExit):
        _parse(["--help"])
    help_text = capsys.readouterr().out
    # Every option says what it is for.
    import re

    options = re.findall(r"^  (--[a-z0-9-]+)", help_text, re.M)
    assert len(options) >= 10
    for opt in options:
        block = help_text.split(opt, 1)[1].split("\n  --", 1)[0]
        assert len(block.split()) > 2, opt


def test_plan_traffic_bounds_the_floor() -> None:
    from prefixattn.bench import plan_traffic

    # Without sharing a plan moves exactly the floor; with sharing it adds partial rows, and
    # counting the repeated reads of shared pages adds more.
    table, lens = tree_batch("8_33", 16, seed=0)
    tr = plan_traffic(PrefixAttention(8, 2, 64, 16).plan(table, lens))
    assert tr["floor"] == tr["plan"] == tr["plan_reads"] > 0
    table, lens = tree_batch("1,64_512,16", 16, seed=0)
    plan = PrefixAttention(32, 8, 64, 16).plan(table, lens)
    tr = plan_traffic(plan)
    assert tr["floor"] == plan.distinct_kv_bytes + plan.qo_bytes
    assert tr["plan"] == tr["floor"] + plan.partial_bytes > tr["floor"]
    assert tr["plan_reads"] >= tr["plan"]


def test_plan_traffic_script_runs(capsys: pytest.CaptureFixture[str]) -> None:
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "plan_traffic.py"
    spec = importlib.util.spec_from_file_location("plan_traffic_script", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--trees", "1,4_64,16", "8_33", "--heads", "32,8", "--page1-trees"]) == 0
    out = capsys.readouterr().out
    assert "1,4_64,16" in out and "geomean: cap" in out


def test_attention_flops_count_every_query_context() -> None:
    from prefixattn.bench import attention_flops

    # Two queries of 10 and 30 keys, 4 q heads, head_dim 8: 4 * 8 * 4 * 40 FLOPs.
    assert attention_flops([10, 30], 4, 8) == 4 * 8 * 4 * 40


def test_ceiling_is_the_slower_of_copy_and_math() -> None:
    from prefixattn.bench import ceiling_columns

    copy_bound = ceiling_columns(floor_us=8.0, copy_us=10.0, math_us=2.0)
    assert copy_bound["ceiling_us"] == 10.0 and copy_bound["pct_floor_ceiling"] == 80.0
    math_bound = ceiling_columns(floor_us=40.0, copy_us=45.0, math_us=80.0)
    assert math_bound["ceiling_us"] == 80.0 and math_bound["pct_floor_ceiling"] == 50.0


def test_summary_and_table_with_ceilings(tmp_path) -> None:
    from prefixattn.bench import _write_table, ceiling_columns, summarize

    rows = []
    for floor, us, copy in ((8.0, 20.0, 10.0), (100.0, 125.0, 105.0)):
        row = {
            "tree": "t",
            "heads": [32, 8],
            "page_size": 16,
            "floor_us": floor,
            "prefixattn_us": us,
            "copy_us": copy,
            "pct_floor": 100 * floor / us,
        }
        row.update(ceiling_columns(floor, copy, 1.0))
        rows.append(row)
    result = summarize("gpu", 4e12, rows)
    assert result["geomean_pct_floor"] == pytest.approx((40.0 * 80.0) ** 0.5)
    assert result["geomean_pct_floor_ceiling"] == pytest.approx((80.0 * 100 / 1.05) ** 0.5)
    assert result["geomean_pct_ceiling"] == pytest.approx((50.0 * 84.0) ** 0.5)
    _write_table(result, tmp_path / "t.md")
    text = (tmp_path / "t.md").read_text()
    assert "ceiling % floor" in text and "| 40 | 80 |" in text
    # Rows without a ceiling (--no-ceiling) give the table and summary of before.
    plain = summarize(
        "gpu",
        4e12,
        [
            {
                k: v
                for k, v in r.items()
                if k in ("tree", "heads", "page_size", "floor_us", "prefixattn_us", "pct_floor")
            }
            for r in rows
        ],
    )
    assert "geomean_pct_floor_ceiling" not in plain
    _write_table(plain, tmp_path / "p.md")
    assert "ceiling" not in (tmp_path / "p.md").read_text()


def test_attention_math_rate_script_needs_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    """benchmarks/attention_math_rate.py (cited in docs/dev/log.md) parses its options and,
    without a CUDA GPU, stops with a message and exit status 1."""
    import importlib.util

    import torch

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "attention_math_rate.py"
    spec = importlib.util.spec_from_file_location("attention_math_rate_script", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the script would run its kernels")
    assert mod.main(["--heads", "32,8", "--backends", "fa3"]) == 1
    assert "needs a CUDA GPU" in capsys.readouterr().err
