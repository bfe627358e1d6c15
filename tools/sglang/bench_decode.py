"""End-to-end decode step time in SGLang: prefixattn against flashinfer and triton, one run.

For SGLang 0.5.17-0.5.23 (the GPU runs use 0.5.23); the result records the version it ran.

An 8B-Llama-shaped model (32 layers, hidden 4096, 32/8 heads, head_dim 128, intermediate
14336, vocab 128256) with dummy weights (``load_format="dummy"``; only config.json is written,
here). Every backend runs in its own subprocess with the same engine settings: decode CUDA
graphs on (SGLang's default), captured at the benchmark's batch sizes only (fewer captures,
shorter start; a smaller batch would be padded up to one), prefill CUDA graphs off (prefill
cancels out of the measurement), ``mem_fraction_static`` 0.8, context length 8192.

Workloads (``KIND:P``), B requests each, 64 private tokens per request:
- ``shared1:P``: one P-token prefix shared by all;
- ``shared3:P``: three levels: a P/2 root, 4 children of P/4, 16 grandchildren of P/4;
- ``none:P``: P + 64 private tokens each.
The default set is ``shared1:1024 shared1:4096 shared3:4096 none:1024`` (``none:4096`` at
256 requests needs about 1.07M KV tokens, 136 GB for this model: more than one GPU holds).
A workload whose tokens do not fit in the engine's KV pool is skipped and reported.

Decode step time: the shared prefixes, then the prompts, are put in the radix cache first
(generations of one token), so every timed generation prefills one token per request; then generations of ``N`` and
``N + S`` tokens are timed alternately ``--repeat`` times, and the step time is the median
over pairs of ``(T(N + S) - T(N)) / S`` (min and max in ``step_spread_ms``;
``tools/timing.py``): the prefill and the fixed per-request costs cancel.
SGLang's own per-step log ("Decode batch, #running-req: B, ... cuda graph: True") is kept
and summarised, so the JSON shows that every timed step ran all B requests in a graph.

    python -m tools.sglang.bench_decode --out DIR [--batch 256] [--budget 520]

``--backends`` may also name ``noattn``, the attention-free bound (``tools/sglang/noattn.py``:
triton's metadata path, no KV reads or writes, no attention math; registered in that engine's
processes only); the results then give each backend's step as a percent of the bound's; and
``prefixfloor``, the bound plus the shared prefix's attention math on FA3
(``tools/prefix_floor.py``), with one ``shared1:P`` workload only. A
backend name may carry options after ``+`` (``prefixattn+split_waves``;
``tools/variants.py``), set in that engine's processes by a plugin
(``tools/sglang/core_options.py``).

``--profile DIR`` also records one more generation per workload with SGLang's torch profiler
(outside the timed runs) and adds each trace's summary (GPU idle time, its longest gaps, the
adapter's host ranges, and per decode step between graph launches: the attention kernels'
time and the rest of the step; ``tools/trace_summary.py``) to the results.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tools import RESULTS, installed_version, write_atomic
from tools.proc_group import run_in_group
from tools.serving.workloads import distinct_tokens
from tools.sglang.core_options import engine_env
from tools.timing import paired_step_ms
from tools.trace_summary import summarize_traces
from tools.variants import check_variants, parse_variant

LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "rms_norm_eps": 1e-5,
    "max_position_embeddings": 8192, "rope_theta": 500000.0, "torch_dtype": "bfloat16",
    "tie_word_embeddings": False, "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip
TAIL = 64
DEFAULT_WORKLOADS = ["shared1:1024", "shared1:4096", "shared3:4096", "none:1024"]
BACKENDS = ["prefixattn", "flashinfer", "triton"]
BOUND = "noattn"
"""The attention-free bound (``tools/sglang/noattn.py``), run when named in ``--backends``."""
FLOOR = "prefixfloor"
"""The bound plus the shared prefix's math on FA3 (``tools/prefix_floor.py``)."""


def floor_tokens(workloads: list[str]) -> int:
    """The prefix length of ``prefixfloor``: that of the run's one ``shared1:P`` workload
    (ValueError otherwise: the floor models one shared prefix)."""
    if len(workloads) != 1 or not workloads[0].startswith("shared1:"):
        raise ValueError(f"{FLOOR} runs one shared1:P workload, not {' '.join(workloads)}")
    return int(workloads[0].split(":")[1])


def workload(spec: str, batch: int, seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """(the B prompts, their distinct shared prefixes: put in the radix cache first, so that
    the prompts' own prefill computes only their private tails)."""
    kind, p = spec.split(":")
    prefix = int(p)
    rng = random.Random(seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(10, 120000) for _ in range(n)]

    if kind == "shared1":
        root = toks(prefix)
        return [root + toks(TAIL) for _ in range(batch)], [root]
    if kind == "shared3":
        root = toks(prefix // 2)
        mids = [toks(prefix // 4) for _ in range(4)]
        lows = [toks(prefix // 4) for _ in range(16)]
        paths = [root + mids[j // 4] + lows[j] for j in range(16)]
        return [paths[i % 16] + toks(TAIL) for i in range(batch)], paths
    if kind == "none":
        return [toks(prefix + TAIL) for _ in range(batch)], []
    raise ValueError(f"unknown workload kind {kind!r} (shared1, shared3, none)")


def bench_backend(
    model: str, backend: str, args: argparse.Namespace, save: Callable[[dict], object]
) -> dict:
    """One engine, in this process: the decode step time of every workload (``save(result)``
    after each, so a later failure keeps the earlier ones)."""
    import sglang as sgl

    if backend == BOUND:
        from tools.sglang.noattn import register

        register()
    elif backend == FLOOR:
        from tools.sglang.noattn import register_floor

        register_floor(floor_tokens(args.workloads))
    base, _ = parse_variant(backend)  # the options reach the scheduler through its plugin
    t0 = time.time()
    llm = sgl.Engine(
        model_path=model, load_format="dummy", skip_tokenizer_init=True,
        attention_backend=base, mem_fraction_static=0.8, context_length=8192,
        max_running_requests=args.batch, cuda_graph_bs_decode=[args.batch],
        disable_prefill_cuda_graph=True, random_seed=0, log_level="info",
        decode_log_interval=8,
    )  # fmt: skip
    out: dict[str, Any] = {"start_s": round(time.time() - t0, 1), "step_ms": {}, "skipped": {}}
    try:
        pool = int(llm.get_server_info().get("max_total_num_tokens") or 0)
        out["kv_pool_tokens"] = pool
        n1, n2 = args.first, args.first + args.steps
        sp = {"temperature": 0, "ignore_eos": True}
        for spec in args.workloads:
            prompts, shared = workload(spec, args.batch)
            need = distinct_tokens(prompts) + args.batch * (n2 + 1)
            if pool and need > 0.9 * pool:
                out["skipped"][spec] = f"needs ~{need} KV tokens, pool holds {pool}"
                print(f"{backend} {spec}: skipped ({out['skipped'][spec]})", flush=True)
                continue
            print(f"=== {backend} {spec} warm", flush=True)
            for warm in (shared, prompts):
                if warm:
                    llm.generate(input_ids=warm, sampling_params={**sp, "max_new_tokens": 1})
            times: dict[int, list[float]] = {n1: [], n2: []}
            for _ in range(args.repeat):
                for n in (n1, n2):
                    print(f"=== {backend} {spec} timed {n}", flush=True)
                    t = time.perf_counter()
                    llm.generate(input_ids=prompts, sampling_params={**sp, "max_new_tokens": n})
                    times[n].append(time.perf_counter() - t)
            step = paired_step_ms(times[n1], times[n2], n1, n2)
            step_ms = step["median"]
            out["step_ms"][spec] = step_ms
            out.setdefault("step_spread_ms", {})[spec] = step
            out.setdefault("gen_s", {})[spec] = {
                n: [round(x, 4) for x in v] for n, v in times.items()
            }
            print(f"{backend} {spec}: decode step {step_ms:.2f} ms", flush=True)
            save(out)
            if args.profile:  # a separate, profiled generation: never in the timings above
                llm.start_profile(output_dir=str(Path(args.profile).resolve() / backend),
                                  activities=["CPU", "GPU"], with_stack=False,
                                  profile_prefix=spec.replace(":", "-"))  # fmt: skip
                llm.generate(input_ids=prompts, sampling_params={**sp, "max_new_tokens": 12})
                llm.stop_profile()
            llm.flush_cache()
    finally:
        llm.shutdown()
    return out


STEP_LINE = re.compile(r"Decode batch.*?#running-req: (\d+).*?cuda graph: (True|False)")


def timed_steps(log: Path) -> dict:
    """SGLang's decode reports (every 8 steps) inside the timed generations, per workload."""
    per: dict[str, dict] = {}
    current = None
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("=== "):
            _, spec, phase = line[4:].split(" ", 2)
            current = spec if phase.startswith("timed") else None
            continue
        m = STEP_LINE.search(line)
        if m and current:
            d = per.setdefault(current, {"reports": 0, "graph": 0, "running_reqs": set()})
            d["reports"] += 1
            d["graph"] += m.group(2) == "True"
            d["running_reqs"].add(int(m.group(1)))
    return {k: {**v, "running_reqs": sorted(v["running_reqs"])} for k, v in per.items()}


def run_one(model: str, backend: str, args: argparse.Namespace, timeout: float) -> dict:
    out: Path = args.out
    result = out / f"bench_decode_{backend}.json"
    log = out / f"bench_decode_{backend}.log"
    result.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "tools.sglang.bench_decode", "--one", backend, "--model", model,
           "--out", str(out), "--batch", str(args.batch), "--first", str(args.first),
           "--steps", str(args.steps), "--repeat", str(args.repeat), "--workloads", *args.workloads,
           *(["--profile", args.profile] if args.profile else [])]  # fmt: skip
    # The bound's registration or a variant's core options, in that engine's processes only.
    env = engine_env(
        backend, out / f"plugins-{backend}", bound=backend == BOUND,
        floor_tokens=floor_tokens(args.workloads) if backend == FLOOR else None,
    )  # fmt: skip
    t0 = time.monotonic()
    code = run_in_group(cmd, timeout, log, env=env)
    wall = round(time.monotonic() - t0, 1)
    print(f"{backend}: exit {code} after {wall} s (log {log})", flush=True)
    data: dict[str, Any] = json.loads(result.read_text()) if result.exists() else {}
    if code != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-15:]
        data["error"] = f"exited {code} after {wall} s"
        data["log_tail"] = tail
    data["wall_s"] = wall
    data["timed_steps"] = timed_steps(log)
    return data


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=RESULTS / "sglang-bench",
                    help=f"folder for results and logs (default {RESULTS}/sglang-bench)")  # fmt: skip
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--workloads", nargs="+", default=DEFAULT_WORKLOADS)
    ap.add_argument("--backends", nargs="+", default=BACKENDS)
    ap.add_argument("--first", type=int, default=8, help="tokens of the shorter generation")
    ap.add_argument("--steps", type=int, default=96, help="extra tokens of the longer one")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--budget", type=float, default=520.0, help="seconds for all backends")
    ap.add_argument("--profile", metavar="DIR",
                    help="after each timing, profile one more generation of 12 tokens into "
                         "DIR/BACKEND and summarize the traces (tools/trace_summary.py)")  # fmt: skip
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    args = ap.parse_args()
    # On SIGTERM (e.g. from `timeout`) unwind, so the engines' process groups get killed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.out.mkdir(parents=True, exist_ok=True)
    for spec in args.workloads:
        workload(spec, 1)  # validate before starting any engine
    check_variants(ap, args.backends, ours="prefixattn")
    if FLOOR in args.backends:
        try:
            floor_tokens(args.workloads)
        except ValueError as e:
            ap.error(str(e))
    if args.one:
        path = args.out / f"bench_decode_{args.one}.json"
        data = bench_backend(args.model, args.one, args, lambda d: write_atomic(path, d))
        write_atomic(path, data)
        return 0

    deadline = time.monotonic() + args.budget
    model = os.path.join(tempfile.mkdtemp(), "llama8b-shape")
    os.makedirs(model)
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump(LLAMA_8B, f)
    results: dict[str, Any] = {"engine_version": installed_version("sglang"), "batch": args.batch,
                               "tail": TAIL, "first": args.first, "steps": args.steps,
                               "repeat": args.repeat, "backends": {}}  # fmt: skip
    for i, backend in enumerate(args.backends):
        left = len(args.backends) - i - 1
        timeout = (deadline - time.monotonic()) / (left + 1) * (1.25 if left else 1.0)
        results["backends"][backend] = run_one(model, backend, args, timeout)
        (args.out / "bench_decode.json").write_text(json.dumps(results, indent=1))

    # Summary: step time per workload and backend, prefixattn's speedup over each.
    steps = {b: r.get("step_ms", {}) for b, r in results["backends"].items()}
    print(f"\ndecode step time (ms), {args.batch} requests, 8B-Llama shape, dummy weights")
    print(f"{'workload':16s}" + "".join(f"{b:>12s}" for b in args.backends))
    speedup: dict[str, dict[str, float]] = {}
    for spec in args.workloads:
        row = [steps[b].get(spec) for b in args.backends]
        print(f"{spec:16s}" + "".join(f"{x:12.2f}" if x else f"{'-':>12s}" for x in row))
        pa = steps.get("prefixattn", {}).get(spec)
        for b in args.backends:
            other = steps[b].get(spec)
            if pa and other and b != "prefixattn":
                speedup.setdefault(spec, {})[b] = round(other / pa, 3)
    results["prefixattn_speedup"] = speedup
    bound = steps.get(BOUND, {})
    results["pct_of_bound"] = {
        spec: {b: round(100 * bound[spec] / steps[b][spec], 1) for b in args.backends
               if b != BOUND and steps[b].get(spec)}
        for spec in args.workloads if bound.get(spec)
    }  # fmt: skip
    if results["pct_of_bound"]:
        print("step time of the bound as % of each backend's:", json.dumps(results["pct_of_bound"]))
    if args.profile:
        results["profile"] = summarize_traces(Path(args.profile), step_marker="cudaGraphLaunch")
    (args.out / "bench_decode.json").write_text(json.dumps(results, indent=1))
    print("speedup of prefixattn (other / prefixattn):", json.dumps(speedup), flush=True)
    return 0 if all("error" not in r for r in results["backends"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
