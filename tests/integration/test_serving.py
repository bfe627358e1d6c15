"""The serving benchmark (tools/serving) without a GPU: workload structure, statistics, the
report, argument checks and the dry run; the bound backends against the installed engines
(skipped where vLLM or SGLang is absent)."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from conftest import sglang_plugin_registers

from tools import write_atomic
from tools.serving import bench, engines
from tools.serving import workloads as wl

ROOT = Path(__file__).resolve().parents[2]


def common_prefix(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def small(**over):
    sizes = wl.parse_sizes([])
    for key, value in over.items():
        w, k = key.split("__")
        sizes[w][k] = value
    return sizes


def test_forest_shares_exactly_system_and_template() -> None:
    sizes = small(forest__requests=96)
    s = sizes["forest"]
    (w,) = wl.build("forest", sizes, seed=3)
    reqs = w.rounds[0]
    assert len(reqs) == 96
    by_tag: dict[str, list] = {}
    for q in reqs:
        by_tag.setdefault(q.tag, []).append(q.prompt)
        user = len(q.prompt) - s["system_len"] - s["template_len"]
        assert s["user_min"] <= user <= s["user_max"]
        assert s["out_min"] <= q.max_tokens <= s["out_max"]
        assert all(wl.MIN_TOKEN <= t < wl.VOCAB for t in q.prompt)
    assert len(by_tag) == s["systems"] * s["templates"]
    shared = s["system_len"] + s["template_len"]
    for prompts in by_tag.values():
        assert all(common_prefix(prompts[0], p) == shared for p in prompts[1:])
    # Same system, other template: the system prompt only; other system: nothing.
    assert common_prefix(by_tag["s0/t0"][0], by_tag["s0/t1"][0]) == s["system_len"]
    assert common_prefix(by_tag["s0/t0"][0], by_tag["s1/t0"][0]) == 0
    # Interleaved: the first batch already spans several templates.
    assert len({q.tag for q in reqs[:16]}) > 4
    distinct = wl.distinct_tokens([q.prompt for q in reqs])
    user_total = sum(len(q.prompt) - shared for q in reqs)
    assert (
        distinct
        == s["systems"] * (s["system_len"] + s["templates"] * s["template_len"]) + user_total
    )


def test_multiturn_prompts_extend_the_previous_turn() -> None:
    sizes = small(multiturn__conversations=5, multiturn__turns=3)
    (w,) = wl.build("multiturn", sizes, seed=1)
    assert len(w.rounds) == 3 and all(len(r) == 5 for r in w.rounds)
    first = wl.resolve_prompts(w.rounds[0])
    system = sizes["multiturn"]["system_len"]
    assert all(common_prefix(first[0], p) >= system for p in first[1:])
    assert all(q.follows is None for q in w.rounds[0])
    rng = random.Random(0)
    outputs = [[rng.randrange(10, 100) for _ in range(q.max_tokens)] for q in w.rounds[0]]
    second = wl.resolve_prompts(w.rounds[1], first, outputs)
    for c, q in enumerate(w.rounds[1]):
        assert q.follows == c
        assert second[c] == first[c] + outputs[c] + list(q.prompt)
    assert wl.resolve_prompts([wl.Request((8, 9), 1, follows=0)], [[5, 6]], [[7]]) == [
        [5, 6, 7, 8, 9]
    ]


def test_sizes_follow_the_arguments() -> None:
    sizes = wl.parse_sizes(["parallel.n=12", "parallel.prompts=3", "decode.requests=7",
                            "decode.prefix=100", "lowload.concurrency=2,8"])  # fmt: skip
    (p,) = wl.build("parallel", sizes)
    assert [q.n for q in p.rounds[0]] == [12] * 3 and p.temperature > 0
    assert p.output_tokens == 3 * 12 * sizes["parallel"]["out"]
    (d,) = wl.build("decode", sizes)
    prompts = [q.prompt for q in d.rounds[0]]
    assert len(prompts) == 7 and all(common_prefix(prompts[0], x) == 100 for x in prompts[1:])
    assert all(q.max_tokens == sizes["decode"]["out"] for q in d.rounds[0])
    low = wl.build("lowload", sizes)
    assert [(w.name, w.concurrency, w.num_requests) for w in low] == [
        ("lowload-c2", 2, 8), ("lowload-c8", 8, 32)
    ]  # fmt: skip
    assert wl.expand_names(["chat", "lowload"], sizes) == ["chat", "lowload-c2", "lowload-c8"]
    (c,) = wl.build("chat", sizes)
    assert wl.distinct_tokens([q.prompt for q in c.rounds[0]]) == sum(
        len(q.prompt) for q in c.rounds[0]
    )
    (lp,) = wl.build("longprompt", sizes)
    assert {len(q.prompt) for q in lp.rounds[0]} == {sizes["longprompt"]["prompt_len"]}


def test_deterministic_by_seed() -> None:
    for name in wl.WORKLOADS:
        assert wl.build(name, seed=5) == wl.build(name, seed=5)
        assert wl.build(name, seed=5) != wl.build(name, seed=6)


@pytest.mark.parametrize(
    "item",
    ["forest.requests", "forest.nope=3", "nope.x=1", "forest.requests=a", "chat.out_min=1,2"],
)
def test_bad_sizes(item: str) -> None:
    with pytest.raises(ValueError, match="bad size"):
        wl.parse_sizes([item])


def test_percentile_and_spread() -> None:
    assert engines.percentile([4, 1, 3, 2], 50) == 2.5
    assert engines.percentile([1, 2, 3, 4], 99) == pytest.approx(3.97)
    assert engines.percentile([7], 99) == 7
    assert engines.percentile([1, 2, 3, 4], 0) == 1 and engines.percentile([1, 2, 3, 4], 100) == 4
    with pytest.raises(ValueError):
        engines.percentile([], 50)
    assert engines.spread([3.0, 1.0, 2.0, 10.0]) == {"median": 2.5, "min": 1.0, "max": 10.0}


def test_run_metrics_and_summary() -> None:
    m = engines.run_metrics(2.0, 1000, 500, ttft_s=[0.1, 0.3], itl_s=[0.01, 0.02, 0.03])
    assert m["output_tok_s"] == 250 and m["total_tok_s"] == 750
    assert m["ttft_ms_p50"] == 200 and m["itl_ms_p50"] == 20
    offline = engines.run_metrics(2.0, 1000, 500)
    assert "ttft_ms_p50" not in offline
    s = engines.summarize_reps([m, {**m, "output_tok_s": 300.0}, {**m, "output_tok_s": 100.0}])
    assert s["output_tok_s"] == {"median": 250, "min": 100, "max": 300} and s["reps"] == 3


def test_stream_latencies() -> None:
    s = engines.Stream(start=10.0)
    s.chunks = {0: [(10.5, 1), (10.6, 1), (10.9, 3)]}
    assert s.ttft == pytest.approx(0.5)
    assert s.itl() == pytest.approx([0.1, 0.1, 0.1, 0.1])
    assert s.output_tokens == 5
    # Samples of one request (n > 1): each its own gaps, the first token of any for the TTFT.
    s.chunks = {0: [(10.5, 1), (10.7, 1)], 1: [(10.4, 1), (10.51, 1), (10.8, 2)]}
    assert s.ttft == pytest.approx(0.4)
    assert s.itl() == pytest.approx([0.2, 0.11, 0.145, 0.145])
    assert s.output_tokens == 6
    s = engines.Stream(start=0.0)
    s.tokens(0)
    s.tokens(2, index=1)
    assert list(s.chunks) == [1] and s.output_tokens == 2 and s.itl() == []
    rng = random.Random(0)
    times = engines.arrival_times(4000, 8.0, rng)
    assert times[0] == 0 and times == sorted(times)
    assert times[-1] / len(times) == pytest.approx(1 / 8, rel=0.1)


class FakeDriver(engines.Driver):
    """Generates ``max_tokens`` tokens per sample, ``chunk`` at a time; records prompts."""

    def __init__(self, chunk: int = 2) -> None:
        self.loop = asyncio.new_event_loop()
        self.chunk = chunk
        self.prompts: list[list[int]] = []

    def output(self, prompt: list[int], q: wl.Request) -> list[int]:
        return [len(prompt) % 1000 + i for i in range(q.max_tokens)]

    def reset_cache(self) -> bool:
        return True

    def generate(self, prompts, reqs, temperature):
        self.prompts += prompts
        outs = [self.output(p, q) for p, q in zip(prompts, reqs, strict=True)]
        return sum(len(o) * q.n for o, q in zip(outs, reqs, strict=True)), outs

    async def stream(self, prompt, q, temperature, on_tokens):
        self.prompts.append(prompt)
        out = self.output(prompt, q)
        for i in range(0, len(out), self.chunk):
            await asyncio.sleep(0)
            for index in range(q.n):
                on_tokens(len(out[i : i + self.chunk]), index)
        return out


@pytest.mark.parametrize("mode", ["offline", "online"])
def test_rounds_follow_the_previous_outputs(mode: str) -> None:
    sizes = small(multiturn__conversations=3, multiturn__turns=3, parallel__prompts=2,
                  parallel__n=3, parallel__out=5)  # fmt: skip
    (mt,) = wl.build("multiturn", sizes)
    (par,) = wl.build("parallel", sizes)
    for w in (mt, par):
        d = FakeDriver()
        run = d.offline(w) if mode == "offline" else d.online(w, 1000.0, 0)
        assert run["output_tokens"] == w.output_tokens
        assert len(d.prompts) == w.num_requests
        if mode == "online":
            assert run["itl_ms_p50"] >= 0 and "ttft_ms_p99" in run
    # Turn k + 1 of a conversation: turn k's prompt, its output, the new message.
    d = FakeDriver()
    d.online(mt, 1000.0, 0)
    by_len = sorted(d.prompts, key=len)
    firsts = wl.resolve_prompts(mt.rounds[0])
    for c, q in enumerate(mt.rounds[1]):
        want = firsts[c] + d.output(firsts[c], mt.rounds[0][c]) + list(q.prompt)
        assert want in by_len


def test_worker_saves_each_timed_run() -> None:
    (w,) = wl.build("decode", small(decode__requests=2, decode__prefix=8, decode__out=4))
    saved: list[dict] = []
    rep_args = types.SimpleNamespace(reps=3, mode="offline", seed=0)
    final = engines.measure(FakeDriver(), w, rep_args, saved.append)
    assert [(s["reps"], s["partial"]) for s in saved] == [(1, True), (2, True)]
    assert final["reps"] == 3 and "partial" not in final and final["cache_resets_ok"]
    args = bench.parse_args(["--engine", "vllm", "--workloads", "decode"])
    cut: dict[str, Any] = {**fake_run(870), "partial": True, "reps": 2}
    runs = {"bound": {"workloads": {"decode": fake_run(1000)}},
            "prefixattn": {"workloads": {"decode": cut}}}  # fmt: skip
    assert "| decode | 1,000 (100%) | 870 (87%) [2 runs] | - | - |" in bench.markdown(
        bench.collect(args, runs)
    )


def test_profile_run_is_one_more_run_under_the_profiler(tmp_path) -> None:
    (w,) = wl.build("decode", small(decode__requests=2, decode__prefix=8, decode__out=4))
    calls: list[str] = []

    class Profiled(FakeDriver):
        def reset_cache(self) -> bool:
            calls.append("reset")
            return True

        def start_profile(self, folder, prefix, steps=0) -> None:
            calls.append(f"start {folder.name} {prefix} {steps}")

        def stop_profile(self) -> None:
            calls.append("stop")

    driver = Profiled()
    engines.profile_run(driver, w, tmp_path / "prefixattn", 50)
    assert calls == ["reset", "start prefixattn decode 50", "stop"] and driver.prompts

    class Failing(Profiled):
        def generate(self, prompts, reqs, temperature):
            raise RuntimeError("engine died")

    calls.clear()
    with pytest.raises(RuntimeError, match="engine died"):
        engines.profile_run(Failing(), w, tmp_path / "x")
    assert calls[-1] == "stop"  # the profiler is stopped anyway
    # Online: the profiled run is an online run at the given rate and seed.
    calls.clear()

    class Online(Profiled):
        def online(self, w, rate, seed):
            calls.append(f"online {rate} {seed}")
            return {}

    engines.profile_run(Online(), w, tmp_path / "prefixattn", 0, (16.0, 3))
    assert calls == ["reset", "start prefixattn decode 0", "online 16.0 3", "stop"]
    # The option: offline only, and the workers get it.
    args = bench.parse_args(["--engine", "sglang", "--profile", str(tmp_path / "p")])
    cmd = bench.worker_cmd(args, "prefixattn", "MODEL", tmp_path / "r.json")
    assert cmd[cmd.index("--profile") + 1] == str((tmp_path / "p").resolve())
    assert cmd[cmd.index("--profile-steps") + 1] == "200"  # a trace written in seconds
    worker = bench.parse_args(cmd[cmd.index("--worker") :])
    assert worker.profile_steps == 200 and worker.worker == "prefixattn"
    online = bench.parse_args(["--engine", "vllm", "--mode", "online", "--profile", "p"])
    cmd = bench.worker_cmd(online, "prefixattn", "MODEL", tmp_path / "r.json")
    assert cmd[cmd.index("--mode") + 1] == "online" and "--profile" in cmd
    with pytest.raises(SystemExit):
        bench.parse_args(["--engine", "sglang", "--profile", "p", "--profile-steps", "-1"])


def test_sglang_profile_of_some_steps_stops_by_itself() -> None:
    """SGLang ends a ``num_steps`` profile itself and then refuses ``stop_profile``; a
    whole-run profile's refusal is still an error."""
    seen: list[dict] = []

    class Engine:
        def start_profile(self, **kwargs) -> None:
            seen.append(kwargs)

        def stop_profile(self) -> None:
            raise RuntimeError("Profiling is not in progress")

    driver = engines.SglangDriver.__new__(engines.SglangDriver)
    driver.engine = Engine()
    driver.start_profile(Path("/tmp/p"), "forest", 100)
    assert seen[-1]["num_steps"] == 100 and seen[-1]["profile_prefix"] == "forest"
    driver.stop_profile()
    driver.start_profile(Path("/tmp/p"), "forest")
    assert seen[-1]["num_steps"] is None
    with pytest.raises(RuntimeError, match="not in progress"):
        driver.stop_profile()

    class Broken(Engine):
        def stop_profile(self) -> None:
            raise RuntimeError("the scheduler died")

    driver.engine = Broken()
    driver.start_profile(Path("/tmp/p"), "forest", 100)
    with pytest.raises(RuntimeError, match="died"):  # only the expected refusal is quiet
        driver.stop_profile()


def test_vllm_profile_of_some_steps_on_older_releases() -> None:
    """vLLM 0.33 takes max_iterations per profile; older releases, whose start_profile has
    no such argument, profile the whole run."""
    calls: list[tuple] = []

    class New:
        def start_profile(self, prefix=None, *, max_iterations=None) -> None:
            calls.append((prefix, max_iterations))

    class Old:
        def start_profile(self, prefix=None) -> None:
            calls.append((prefix, "whole"))

    driver = engines.VllmDriver.__new__(engines.VllmDriver)
    driver.online_mode = False
    driver.llm = New()
    driver.start_profile(Path("/tmp/p"), "forest", 50)
    driver.llm = Old()
    driver.start_profile(Path("/tmp/p"), "forest", 50)
    driver.start_profile(Path("/tmp/p"), "chat")
    assert calls == [("forest", 50), ("forest", "whole"), ("chat", "whole")]
    # Online, AsyncLLM's coroutines on the driver's loop.
    import asyncio

    class Async:
        async def start_profile(self, prefix=None, *, max_iterations=None) -> None:
            calls.append(("async", prefix, max_iterations))

        async def stop_profile(self) -> None:
            calls.append(("async stop",))

    calls.clear()
    driver.online_mode, driver.engine = True, Async()
    driver.loop = asyncio.new_event_loop()
    try:
        driver.start_profile(Path("/tmp/p"), "forest", 300)
        driver.stop_profile()
        driver.start_profile(Path("/tmp/p"), "forest")
    finally:
        driver.loop.close()
    assert calls == [("async", "forest", 300), ("async stop",), ("async", "forest", None)]


def test_sglang_stream_chunks_are_cumulative_per_sample() -> None:
    class Engine:
        async def async_generate(self, input_ids, sampling_params, stream):
            assert stream and sampling_params["n"] == 2

            async def chunks():
                done: dict[int, list[int]] = {0: [], 1: []}
                for index, tok in [(0, 5), (1, 7), (1, 8), (0, 6), (1, 9), (0, 4)]:
                    done[index].append(tok)
                    n = len(done[index])
                    yield {"index": index, "output_ids": done[index],
                           "meta_info": {"completion_tokens": n}}  # fmt: skip

            return chunks()

    d: Any = object.__new__(engines.SglangDriver)
    d.engine = Engine()
    s = engines.Stream(0.0)
    ids = asyncio.run(d.stream([1, 2], wl.Request((1, 2), 3, n=2), 1.0, s.tokens))
    assert ids == [5, 6, 4]
    assert {i: [k for _, k in c] for i, c in s.chunks.items()} == {0: [1, 1, 1], 1: [1, 1, 1]}


def test_vllm_stream_deltas_per_sample() -> None:
    pytest.importorskip("vllm")
    from vllm.sampling_params import RequestOutputKind

    def out(*completions):
        return types.SimpleNamespace(
            outputs=[types.SimpleNamespace(index=i, token_ids=t) for i, t in completions]
        )

    class Engine:
        def generate(self, prompt, sp, request_id):
            assert sp.n == 2 and sp.output_kind == RequestOutputKind.DELTA

            async def outs():
                yield out((1, [7]))
                yield out((0, [5, 6]), (1, [8]))
                yield out((0, [4]))

            return outs()

    d: Any = object.__new__(engines.VllmDriver)
    d.engine, d.ids = Engine(), itertools.count()
    s = engines.Stream(0.0)
    ids = asyncio.run(d.stream([1, 2], wl.Request((1, 2), 3, n=2), 1.0, s.tokens))
    assert ids == [5, 6, 4]
    assert {i: [k for _, k in c] for i, c in s.chunks.items()} == {1: [1, 1], 0: [2, 1]}


def fake_run(tok_s: float, ttft: float | None = None) -> dict:
    r = {"output_tok_s": {"median": tok_s, "min": tok_s, "max": tok_s}}
    if ttft is not None:
        for k in ("ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99"):
            r[k] = {"median": ttft, "min": ttft, "max": ttft}
    return r


def test_percent_of_bound_and_markdown(tmp_path) -> None:
    args = bench.parse_args(["--engine", "vllm", "--workloads", "decode", "lowload",
                             "--size", "lowload.concurrency=1,4", "--out", str(tmp_path / "r.json")])  # fmt: skip
    runs = {
        "bound": {"finished": True, "workloads": {"decode": fake_run(1000), "lowload-c1": fake_run(200),
                                                  "lowload-c4": fake_run(400)}},
        "prefixattn": {"finished": True, "workloads": {"decode": fake_run(870), "lowload-c1": fake_run(150)}},
        "FLASH_ATTN": {"finished": False, "error": "exited 1", "workloads": {}},
    }  # fmt: skip
    result = bench.collect(args, runs)
    assert result["results"]["decode"]["prefixattn"]["pct_of_bound"] == 87.0
    assert result["results"]["decode"]["bound"]["pct_of_bound"] == 100.0
    assert result["results"]["lowload-c1"]["prefixattn"]["pct_of_bound"] == 75.0
    assert "prefixattn" not in result["results"]["lowload-c4"]
    assert result["backends"]["FLASH_ATTN"]["error"] == "exited 1"
    assert result["workloads"]["lowload-c4"]["concurrency"] == 4
    table = bench.markdown(result)
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    assert rows[0] == "| workload | bound | prefixattn | FLASH_ATTN | FLASHINFER |"
    assert rows[1] == "| decode | 1,000 (100%) | 870 (87%) | - | - |"
    assert rows[3] == "| lowload-c4 | 400 (100%) | - | - | - |"
    json.dumps(result)  # the report is plain JSON


def test_online_markdown_has_latencies() -> None:
    args = bench.parse_args(["--engine", "sglang", "--mode", "online", "--workloads", "chat"])
    runs = {"bound": {"workloads": {"chat": fake_run(500, 12.0)}},
            "prefixattn": {"workloads": {"chat": fake_run(450, 20.0)}}}  # fmt: skip
    table = bench.markdown(bench.collect(args, runs))
    assert "| chat | 500 (100%) | 450 (90%) | - | - | - |" in table
    assert "| chat | 12.0 / 12.0 | 20.0 / 20.0 | - | - | - |" in table
    assert "time to first token" in table and "inter-token latency" in table


def test_plot(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    args = bench.parse_args(["--engine", "vllm", "--workloads", "decode"])
    runs = {"bound": {"workloads": {"decode": fake_run(1000)}},
            "prefixattn": {"workloads": {"decode": fake_run(870)}}}  # fmt: skip
    bench.plot(bench.collect(args, runs), tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0


def test_plot_without_bound(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    args = bench.parse_args(["--engine", "vllm", "--workloads", "decode"])
    runs: dict[str, dict[str, Any]] = {"bound": {"finished": False, "workloads": {}},
                                       "prefixattn": {"workloads": {"decode": fake_run(870)}}}  # fmt: skip
    result = bench.collect(args, runs)
    assert "pct_of_bound" not in result["results"]["decode"]["prefixattn"]
    bench.plot(result, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0
    assert "| decode | - | 870 | - | - |" in bench.markdown(result)


def test_result_written_whole(tmp_path) -> None:
    path = tmp_path / "result.json"
    write_atomic(path, {"workloads": {"a": 1}})
    write_atomic(path, {"workloads": {"a": 1, "b": 2}})
    assert json.loads(path.read_text()) == {"workloads": {"a": 1, "b": 2}}
    assert [p.name for p in tmp_path.iterdir()] == ["result.json"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--engine", "vllm", "--workloads", "forrest"], "invalid choice: 'forrest'"),
        (["--engine", "vllm", "--backends", "fa3"], "unknown backend(s) for vllm: fa3"),
        (["--engine", "sglang", "--backends", "bound", "FLASH_ATTN"], "unknown backend(s) for sglang"),
        (["--engine", "tgi"], "invalid choice: 'tgi'"),
        (["--engine", "vllm", "--size", "forest.users=3"], "bad size 'forest.users=3'"),
        (["--engine", "vllm", "--backends", "bound", "bound"], "twice"),
        (["--engine", "vllm", "--reps", "0"], "--reps must be at least 1"),
        (["--engine", "vllm", "--passes", "0"], "--passes must be at least 1"),
        (["--engine", "vllm", "--passes", "2", "--profile", "/tmp/p"], "--profile takes one pass"),
    ],
)  # fmt: skip
def test_bad_arguments(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        bench.parse_args(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_backend_order_and_defaults() -> None:
    args = bench.parse_args(["--engine", "vllm", "--backends", "FLASH_ATTN", "bound"])
    assert args.backends == ["bound", "FLASH_ATTN"]
    args = bench.parse_args(["--engine", "sglang"])
    assert args.backends == list(bench.BACKENDS["sglang"]) and args.workloads == list(wl.WORKLOADS)


def test_passes_alternate_the_order_and_pool_the_runs(tmp_path, monkeypatch) -> None:
    """``--passes 2``: every backend starts twice, the second time in reverse order (the
    bound first in both), each start's log kept, and each backend's medians taken over the
    timed runs of both starts."""
    assert bench.pass_order(["bound", "A", "B"], 2) == ["bound", "A", "B", "bound", "B", "A"]
    assert bench.pass_order(["A", "B", "C"], 3) == ["A", "B", "C", "C", "B", "A", "A", "B", "C"]
    assert bench.pass_order(["A", "B"], 1) == ["A", "B"]
    calls: list[tuple[str, str]] = []
    ttft = {"prefixattn": iter([10.0, 12.0, 14.0, 30.0, 32.0, 34.0]),
            "FLASH_ATTN": iter([20.0, 21.0, 22.0, 23.0, 24.0, 25.0, 26.0, 27.0, 28.0])}  # fmt: skip

    def fake_run_backend(args, backend, model, timeout, tag=""):
        calls.append((backend, tag))
        runs = []
        for _ in range(3):
            t = next(ttft[backend])
            runs.append({"output_tok_s": 100.0, "ttft_ms_p50": t, "ttft_ms_p99": 2 * t,
                         "itl_ms_p50": 6.0, "itl_ms_p99": 30.0})  # fmt: skip
        summary = {**engines.summarize_reps(runs), "runs": runs, "cache_resets_ok": True}
        return {"finished": True, "exit": 0, "wall_s": 1.0, "engine_start_s": 0.5,
                "log": f"r_{backend}{tag}.log", "workloads": {"forest": summary}}  # fmt: skip

    monkeypatch.setattr(bench, "run_backend", fake_run_backend)
    monkeypatch.setattr(bench, "gpu_name", lambda: None)
    monkeypatch.setattr("tools.vllm.bench_decode.write_model", lambda path, n: None)
    out = tmp_path / "r.json"
    argv = ["--engine", "vllm", "--mode", "online", "--workloads", "forest", "--backends",
            "prefixattn", "FLASH_ATTN", "--passes", "2", "--out", str(out)]  # fmt: skip
    monkeypatch.setattr(bench, "plot", lambda result, path: None)
    assert bench.main(argv) == 0
    assert calls == [("prefixattn", ""), ("FLASH_ATTN", ""), ("FLASH_ATTN", "-pass2"),
                     ("prefixattn", "-pass2")]  # fmt: skip
    result = json.loads(out.read_text())
    ours = result["results"]["forest"]["prefixattn"]
    assert ours["reps"] == 6 and len(ours["runs"]) == 6
    assert ours["ttft_ms_p50"]["median"] == 22.0  # of 10 12 14 30 32 34
    assert ours["ttft_ms_p50"]["min"] == 10.0 and ours["ttft_ms_p50"]["max"] == 34.0
    assert len(result["backends"]["prefixattn"]["passes"]) == 2
    assert result["backends"]["prefixattn"]["finished"] is True
    assert "median of 6 runs" in out.with_suffix(".md").read_text()
    assert "partial" not in ours and "[6 runs]" not in out.with_suffix(".md").read_text()
    assert result["backends"]["prefixattn"]["passes"][1]["log"].endswith("-pass2.log")
    # A pass that was cut off keeps the runs it has, marks them fewer than the passes would
    # give (the table shows their count) and the backend unfinished.
    first = fake_run_backend(None, "FLASH_ATTN", "", 0.0)
    cut = {"finished": False, "exit": 124, "error": "exited 124 after 9 s", "workloads": {}}
    pooled = bench.pool_passes(first, cut)
    assert pooled["finished"] is False and pooled["workloads"]["forest"]["reps"] == 3
    assert pooled["workloads"]["forest"]["partial"] is True
    assert pooled["error"] == "exited 124 after 9 s"
    # A first pass that never reached the workload: the later pass's runs alone, marked.
    late = bench.pool_passes({"finished": False, "workloads": {}}, first)
    assert late["workloads"]["forest"]["reps"] == 3 and late["workloads"]["forest"]["partial"]


def test_first_engine_start_gets_a_larger_share() -> None:
    """The first run of a call pays the cold compile caches: it gets FIRST_START_SHARES of
    an even share, the others split what is left evenly, and all shares of one call add up
    to the budget when every run takes its whole share."""
    k = bench.FIRST_START_SHARES
    assert k > 1
    assert bench.budget_share(600.0, 0, 1) == 600.0
    first = bench.budget_share(600.0, 0, 4)
    assert abs(first - 600.0 * k / (k + 3)) < 1e-9 and first > 600.0 / 4
    left = 600.0 - first
    shares = [bench.budget_share(left - j * left / 3, j + 1, 4) for j in range(3)]
    assert all(abs(s - left / 3) < 1e-9 for s in shares)
    assert abs(first + sum(shares) - 600.0) < 1e-9


def test_worker_environment(tmp_path) -> None:
    offline = bench.parse_args(["--engine", "vllm"])
    online = bench.parse_args(["--engine", "vllm", "--mode", "online"])
    sampler = {"VLLM_USE_FLASHINFER_SAMPLER": "0"}
    for b in bench.BACKENDS["vllm"]:
        assert bench.worker_env(offline, b, tmp_path) == {
            **sampler,
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        }
        assert bench.worker_env(online, b, tmp_path) == {
            **sampler,
            "VLLM_WORKER_MULTIPROC_METHOD": "fork",
        }
    sgl = bench.parse_args(["--engine", "sglang"])
    assert bench.worker_env(sgl, "fa3", tmp_path) == {}
    env = bench.worker_env(sgl, "bound", tmp_path)
    plugin = tmp_path / "noattn-plugin"
    assert env["PYTHONPATH"].split(os.pathsep)[:2] == [str(plugin), str(ROOT)]
    eps = (plugin / "prefixattn_bench_noattn-0.0.dist-info" / "entry_points.txt").read_text()
    assert "[sglang.srt.plugins]" in eps and "tools.sglang.noattn:register" in eps


def test_dry_run_imports_no_engine() -> None:
    code = (
        "import sys; from tools.serving import bench;"
        "bench.main(['--engine', 'sglang', '--dry-run', '--workloads', 'forest', 'lowload']);"
        "assert not [m for m in sys.modules if m.split('.')[0] in ('vllm', 'sglang', 'torch')]"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "backends bound prefixattn fa3 triton flashinfer" in out
    assert "lowload-c16" in out and "--worker bound" in out and "PYTHONPATH=" in out


def test_vllm_bound_backend() -> None:
    pytest.importorskip("vllm")
    torch = pytest.importorskip("torch")
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend, FlashAttentionImpl
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from tools.vllm import noattn

    assert issubclass(noattn.NoAttentionBackend, FlashAttentionBackend)
    assert issubclass(noattn.NoAttentionImpl, FlashAttentionImpl)
    b = noattn.NoAttentionBackend
    assert b.get_builder_cls() is FlashAttentionBackend.get_builder_cls()
    assert b.forward_includes_kv_cache_update is False
    noattn.register()
    noattn.register()
    member = AttentionBackendEnum[noattn.NAME]
    assert member.get_class() is b
    assert AttentionBackendEnum[b.get_name()] is member  # vLLM's Attention layer looks it up
    from vllm.config.attention import AttentionConfig

    assert AttentionConfig.validate_backend_before("NOATTN") is member
    impl = object.__new__(noattn.NoAttentionImpl)  # the constructor needs a GPU's FA version
    out = torch.ones(5, 4, 8)
    assert impl.forward(None, out, out, out, None, None, output=out) is out
    assert not out.any()
    impl.do_kv_cache_update(None, out, out, None, None)  # writes nothing, needs no cache


def test_sglang_bound_backend(tmp_path) -> None:
    pytest.importorskip("sglang")
    torch = pytest.importorskip("torch")
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    from tools.sglang import noattn

    cls = noattn.backend_class()
    assert issubclass(cls, TritonAttnBackend)
    backend: Any = object.__new__(cls)  # the constructor needs a model runner on a GPU
    layer = types.SimpleNamespace(tp_q_head_num=4, qk_head_dim=8, v_head_dim=8)
    q = torch.ones(3, 32, dtype=torch.bfloat16)
    out = backend.forward_decode(q, q, q, layer, types.SimpleNamespace())
    assert out.shape == (3, 32) and out.dtype == torch.bfloat16 and not out.any()
    buf = torch.ones(3, 32)
    fb = types.SimpleNamespace(_attn_output=buf)
    assert backend.forward_extend(q, q, q, layer, fb) is buf and not buf.any()
    # The scheduler is a spawned process: it must find the backend through load_plugins().
    env = noattn.plugin_env(tmp_path / "plugin")
    assert sglang_plugin_registers(env, tmp_path, "noattn") == "registered (True, True)"


def test_backends_whose_kernels_do_not_import_are_skipped(tmp_path, monkeypatch) -> None:
    """A real import in a fresh interpreter: SGLang's fa3 imports sgl_kernel.flash_attn; a
    package of that name on PYTHONPATH (ahead of any installed one) that cannot give it makes
    the backend skipped with the import's error, before any engine starts. Backends without
    a preflight import are never skipped."""
    from tools.serving import bench

    pkg = tmp_path / "sgl_kernel"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "flash_attn.py").write_text("raise ImportError('no FA3 in this build')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    reason = bench.unavailable("sglang", "fa3")
    assert reason is not None and "no FA3 in this build" in reason
    assert bench.unavailable("sglang", "triton") is None
    assert bench.unavailable("vllm", "prefixattn+split_waves") is None
    (tmp_path / "flashinfer.py").write_text("")  # an importable module of that name
    assert bench.unavailable("sglang", "flashinfer") is None
    (pkg / "flash_attn.py").write_text("def flash_attn_with_kvcache(): pass\n")
    assert bench.unavailable("sglang", "fa3") is None
    (pkg / "flash_attn.py").write_text("raise ImportError('no FA3 in this build')\n")
    args = bench.parse_args(["--engine", "sglang", "--backends", "fa3", "--out",
                             str(tmp_path / "r.json")])  # fmt: skip
    data = bench.run_backend(args, "fa3", "MODEL", 5.0)
    assert data["finished"] is False and "no FA3 in this build" in data["skipped"]


def test_planner_counts_from_a_worker_log(tmp_path) -> None:
    """The last counts line a prefixattn planner logged (``+count_fallbacks``) goes into the
    backend's results; a log without one, or a cut-off line, gives none."""
    log = tmp_path / "w.log"
    first = {"plans": {"copy": 1, "unshared": 0, "hinted": 199}, "fallbacks": 0}
    last = {
        "plans": {"copy": 1, "unshared": 2, "hinted": 397},
        "hint_rows": {"kept": 9, "moved": 1, "unknown": 0},
        "host_ms_per_plan": {"copy": 12.5, "hinted": 0.71},
        "fallbacks": 3,
    }
    log.write_text(
        "INFO something\n"
        f"[2026-11-28 15:31:15] prefixattn step planner counts: {first}\n"
        "Capturing batches (bs=256)\n"
        f"(EngineCore pid=7) WARNING prefixattn step planner counts: {last}\n"
    )
    assert bench.planner_counts(log) == last
    log.write_text("prefixattn step planner counts: {'plans': {'copy'\n")
    assert bench.planner_counts(log) is None
    log.write_text("no counts here\n")
    assert bench.planner_counts(log) is None
    assert bench.planner_counts(tmp_path / "missing.log") is None


def test_profiled_workers_name_a_range_at_each_step(tmp_path) -> None:
    """A profiled SGLang run's engines start each step with the range its summary splits
    steps by (the step-marker plugin, kept beside the bound's plugin, and found under its own
    distribution name: a name that parsed as ``prefixattn`` hid the real package's entry
    point). vLLM names its profiled steps itself: its workers' environment is unchanged."""
    from importlib.metadata import distributions

    vargs = bench.parse_args(["--engine", "vllm", "--profile", str(tmp_path / "p")])
    assert bench.worker_env(vargs, "prefixattn", tmp_path) == bench.worker_env(
        bench.parse_args(["--engine", "vllm"]), "prefixattn", tmp_path
    )
    sargs = bench.parse_args(["--engine", "sglang", "--profile", str(tmp_path / "p")])
    env = bench.worker_env(sargs, "bound", tmp_path / "b")
    path = env["PYTHONPATH"].split(os.pathsep)
    folder = tmp_path / "b" / "stepmark"
    assert str(folder) in path and str(tmp_path / "b" / "noattn-plugin") in path
    (dist,) = distributions(path=[str(folder)])
    assert dist.metadata["Name"] == dist.name == "prefixattn_bench_stepmark"
    (ep,) = dist.entry_points
    assert (ep.group, ep.value) == ("sglang.srt.plugins", "tools.sglang.stepmark:register")
    assert "PYTHONPATH" not in bench.worker_env(
        bench.parse_args(["--engine", "sglang"]), "triton", tmp_path / "c"
    )
    assert bench.STEP_MARKER == {"vllm": "execute_context_", "sglang": "sglang.forward"}


def _run_gpu(command: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """``bash tools/serving/run_gpu.sh COMMAND ARGS`` with ``env`` (DRY_RUN=1 in the tests)."""
    script = Path(__file__).resolve().parents[2] / "tools/serving/run_gpu.sh"
    return subprocess.run(["bash", str(script), command, *args], env=env, capture_output=True,
                          text=True, timeout=60, check=False)  # fmt: skip


def test_run_gpu_script_runs_pytest_on_the_vllm_stack(tmp_path) -> None:
    """tools/serving/run_gpu.sh pytest (DRY_RUN=1): the tests named, on the vLLM stack with
    the SGLang stack's torchvision (the image's does not load beside the stack's torch, and
    ``import vllm`` reaches it through transformers)."""
    vstack, sstack = tmp_path / "v", tmp_path / "s"
    vstack.mkdir()
    (sstack / "torchvision").mkdir(parents=True)
    out = tmp_path / "out"
    env = {**os.environ, "DRY_RUN": "1", "VLLM_STACK": str(vstack), "SGLANG_STACK": str(sstack),
           "PA": "/pa", "OUT": str(out)}  # fmt: skip
    done = _run_gpu("pytest", env, "tests/gpu/test_vllm_flash_attn_cache.py", "-x")
    assert done.returncode == 0, done.stderr
    assert (
        f"PYTHONPATH=/pa:{vstack}:{out}/torchvision-path python3 -m pytest -q -p "
        "no:cacheprovider tests/gpu/test_vllm_flash_attn_cache.py -x"
    ) in done.stdout


def test_run_gpu_script_runs_each_engine_on_its_gpu_and_stack(tmp_path) -> None:
    """tools/serving/run_gpu.sh (DRY_RUN=1: the commands only): vLLM on GPU 0 and SGLang on
    GPU 1 (on a machine of one GPU, both on GPU 0), each with its own stack on the path; cutlass's folder for SGLang (its .pth is not
    read from a --target install) and the SGLang stack's torchvision for vLLM."""
    vstack, sstack = tmp_path / "v", tmp_path / "s"
    (sstack / "nvidia_cutlass_dsl" / "dsl_packages").mkdir(parents=True)
    (sstack / "torchvision").mkdir()
    (sstack / "torchvision-0.29.0.dist-info").mkdir()
    vstack.mkdir()
    out = tmp_path / "out"
    env = {**os.environ, "DRY_RUN": "1", "VLLM_STACK": str(vstack), "SGLANG_STACK": str(sstack),
           "PA": "/pa", "OUT": str(out), "BUDGET": "300", "GPUS": "2",
           "VLLM_ARGS": "--workloads forest --backends bound readfloor",
           "SGLANG_ARGS": "--workloads forest --profile /tmp/none"}  # fmt: skip
    done = _run_gpu("run", env)
    assert done.returncode == 0, done.stderr
    vllm = (out / "vllm.log").read_text()
    sglang = (out / "sglang.log").read_text()
    assert "--engine vllm --budget 280" in vllm and "--backends bound readfloor" in vllm
    assert "--engine sglang --budget 280" in sglang and "--profile /tmp/none" in sglang
    assert f"CUDA_VISIBLE_DEVICES=0 PYTHONPATH=/pa:{vstack}:{out}/torchvision-path " in vllm
    cutlass = sstack / "nvidia_cutlass_dsl" / "dsl_packages"
    assert f"CUDA_VISIBLE_DEVICES=1 PYTHONPATH=/pa:{sstack}:{cutlass}:{vstack} " in sglang
    assert (out / "torchvision-path" / "torchvision").is_symlink()
    assert (out / "torchvision-path" / "torchvision-0.29.0.dist-info").is_symlink()
    missing = _run_gpu("run", {**env, "VLLM_ARGS": "", "SGLANG_ARGS": ""})
    assert missing.returncode == 2 and "set VLLM_ARGS and/or SGLANG_ARGS" in missing.stderr
    # One GPU: both engines on it (one after the other).
    one = _run_gpu("run", {**env, "GPUS": "1"})
    assert one.returncode == 0, one.stderr
    assert "CUDA_VISIBLE_DEVICES=1" not in one.stdout
    assert f"CUDA_VISIBLE_DEVICES=0 PYTHONPATH=/pa:{vstack}:{out}/torchvision-path " in one.stdout
    assert f"CUDA_VISIBLE_DEVICES=0 PYTHONPATH=/pa:{sstack}:{cutlass}:{vstack} " in one.stdout


def test_run_gpu_script_runs_the_matrix_on_each_stack(tmp_path) -> None:
    """tools/serving/run_gpu.sh matrix (DRY_RUN=1): the matrix for vLLM, then SGLang, each on
    its own stack, under BUDGET, reports named by engine."""
    vstack, sstack = tmp_path / "v", tmp_path / "s"
    vstack.mkdir()
    sstack.mkdir()
    out = tmp_path / "out"
    env = {**os.environ, "DRY_RUN": "1", "VLLM_STACK": str(vstack), "SGLANG_STACK": str(sstack),
           "PA": "/pa", "OUT": str(out), "BUDGET": "300", "VLLM_ARGS": "--select delegate",
           "SGLANG_ARGS": "--select delegate --cells forest"}  # fmt: skip
    done = _run_gpu("matrix", env)
    assert done.returncode == 0, done.stderr
    vllm = (out / "matrix-vllm.log").read_text()
    sglang = (out / "matrix-sglang.log").read_text()
    assert f"PYTHONPATH=/pa:{vstack} " in vllm and "--engines vllm --budget 280" in vllm
    assert f"--out-json {out}/matrix-vllm.json --select delegate" in vllm
    assert f"PYTHONPATH=/pa:{sstack}:{vstack} " in sglang and "--cells forest" in sglang
    missing = _run_gpu("matrix", {**env, "VLLM_ARGS": "", "SGLANG_ARGS": ""})
    assert missing.returncode == 2 and "set VLLM_ARGS and/or SGLANG_ARGS" in missing.stderr


def test_sglang_step_marker_wraps_each_forward_once(monkeypatch) -> None:
    """tools/sglang/stepmark.py on a stand-in for SGLang's model runner: the forward pass runs
    inside one profiler range of its name, returns what it returned, and registering twice
    wraps it once."""
    import torch

    from tools.sglang import stepmark

    class ModelRunner:
        def forward(self, batch: int, skip: bool = False) -> int:
            return batch * 2 + skip

    names = ["sglang", "sglang.srt", "sglang.srt.model_executor"]
    for name in names:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    runner_module = types.ModuleType("sglang.srt.model_executor.model_runner")
    runner_module.ModelRunner = ModelRunner  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, runner_module.__name__, runner_module)
    original = ModelRunner.forward
    stepmark.register()
    stepmark.register()
    assert ModelRunner.forward.__wrapped__ is original  # type: ignore[attr-defined]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        assert ModelRunner().forward(3, skip=True) == 7
    ranges = [e.name for e in prof.events() if e.name == stepmark.MARKER]
    assert ranges == [stepmark.MARKER]
