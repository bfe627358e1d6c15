"""Serving benchmark: prefixattn, the engine's own backends and the attention-free bound.

For vLLM 0.33.0 and SGLang 0.5.23 (the result records the versions it ran). The model is
``tools/vllm/bench_decode.py``'s 8B-Llama shape with dummy weights (``write_model``), bf16,
prefix caching on, the engine's default CUDA graphs. Workloads are in
``tools/serving/workloads.py`` (sizes: ``--size WORKLOAD.KEY=VALUE``).

Backends (``--backends``, default all of the engine's):

- vLLM: ``prefixattn`` (``attention_backend="CUSTOM"``, the installed plugin), ``FLASH_ATTN``,
  ``FLASHINFER``, ``bound`` (``tools/vllm/noattn.py``, registered as ``NOATTN``), and, only
  when named, ``readfloor`` (``KVFLOOR``: the bound plus each step's distinct KV read once
  per layer, ``tools/kv_floor.py``; the most an exact attention backend can reach; in
  SGLang ``kvfloor``, with a plugin like the bound's);
- SGLang: ``prefixattn``, ``fa3``, ``triton``, ``flashinfer``, ``bound``
  (``tools/sglang/noattn.py``, ``noattn``, reaching the scheduler through a plugin entry point
  put on the bound engine's ``PYTHONPATH`` only).

``prefixattn`` may carry options after ``+`` (``prefixattn+split_waves``;
``tools/variants.py``): vLLM takes them in ``additional_config``, SGLang's scheduler from a
plugin (``tools/sglang/core_options.py``).

Each backend runs in its own process group (``tools/proc_group.py``) with a share of
``--budget`` seconds (the call's first engine start, which fills the compile caches, a larger
one: :func:`budget_share`), the bound first; a worker writes its results after every timed
run, so a timeout keeps what finished (a workload cut off after some of its runs is marked
``partial``; ``[k runs]`` in the table), and a backend that fails to start is recorded with
its log's tail.
A built-in backend whose kernels do not import in the engine's environment (``PREFLIGHT``:
SGLang's ``fa3`` imports ``sgl_kernel.flash_attn``) is skipped with the import's error before
its engine starts, and its share of the budget goes to the others.
vLLM's offline engines run with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (engine core in the
worker, where the bound is registered); online, ``AsyncLLM`` forks its engine core
(``VLLM_WORKER_MULTIPROC_METHOD=fork``). Both settings apply to every vLLM backend alike.

- ``--mode offline``: every round's requests at once; output tokens/s (and prompt + output
  tokens/s), one untimed warm-up, then ``--reps`` runs, each after a prefix-cache reset
  (median, min, max).
- ``--mode online``: Poisson arrivals at ``--rate`` requests/s (``lowload``: closed loops of 1,
  4, 16 clients) through the async API; time to first token and inter-token latency (p50,
  p99) besides the throughput.

Each backend's median throughput is also given as a percentage of the bound's. Output: the
JSON (``--out``), a Markdown table next to it (``.md``, also printed) and a bar plot
(``.png``)::

    python -m tools.serving.bench --engine vllm --workloads forest decode --reps 3
    python -m tools.serving.bench --engine sglang --mode online --rate 8 --workloads chat
    python -m tools.serving.bench --engine vllm --dry-run   # the plan, no engine imported

``--profile DIR``: after a workload's timed runs, one more run (offline, or online at
``--rate`` with arrivals of its own) under the engine's
torch profiler (traces in ``DIR/BACKEND``, never in the timings), summarised into the JSON
(``tools/trace_summary.py``: GPU busy and idle time, the longest idle gaps and the host
ranges in them, the attention kernels' time and the kernels that took the most). The trace
covers the profiled run's first ``--profile-steps`` engine steps (200; 0: the whole run,
whose trace can take minutes to write: give such runs smaller sizes).

``prefixattn+count_fallbacks`` (any ``+`` variant: ``tools/variants.py``) logs the planner's
counts every 200 planned steps; the last of them goes into that backend's results as
``planner_counts`` (plan kinds, hint rows, mean host milliseconds per plan, fallbacks).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tools import RESULTS, installed_version, write_atomic
from tools.proc_group import run_in_group
from tools.serving.workloads import WORKLOADS, build, expand_names, parse_sizes
from tools.variants import check_variants

# The start of the host range each engine step opens in a profile: vLLM's worker names every
# profiled step by its prefill chunks and decodes ("execute_context_2(700)_generation_254(254)");
# SGLang's comes from tools/sglang/stepmark.py.
STEP_MARKER = {"vllm": "execute_context_", "sglang": "sglang.forward"}
BACKENDS = {
    "vllm": ("bound", "prefixattn", "FLASH_ATTN", "FLASHINFER"),
    "sglang": ("bound", "prefixattn", "fa3", "triton", "flashinfer"),
}
READ_FLOOR = "readfloor"
FLOORS = {"vllm": (READ_FLOOR,), "sglang": (READ_FLOOR,)}
"""Backends run only when named: the bound plus the step's distinct KV read once per layer
(``tools/kv_floor.py``), the most any exact attention backend can reach on the same traffic."""
BOUND = "bound"
METRIC = "output_tok_s"
PREFLIGHT = {
    ("sglang", "fa3"): "from sgl_kernel.flash_attn import flash_attn_with_kvcache",
    ("sglang", "flashinfer"): "import flashinfer",
    ("vllm", "FLASHINFER"): "import flashinfer",
}
"""An import each of these backends needs, tried in a fresh interpreter before its engine
starts (SGLang reports a missing FA3 only after loading the model)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m tools.serving.bench", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--engine", choices=sorted(BACKENDS), required=True)
    ap.add_argument("--backends", nargs="+", metavar="BACKEND",
                    help="vllm: " + " ".join(BACKENDS["vllm"]) + "; sglang: "
                         + " ".join(BACKENDS["sglang"]) + "; readfloor (the bound plus the "
                         "distinct KV read) only when named (default: all the others; "
                         "the bound runs "
                         "first)")  # fmt: skip
    ap.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    ap.add_argument("--size", action="append", default=[], metavar="WORKLOAD.KEY=VALUE",
                    help="override a workload size, e.g. forest.requests=320 or "
                         "lowload.concurrency=1,8 (repeatable)")  # fmt: skip
    ap.add_argument("--mode", choices=("offline", "online"), default="offline")
    ap.add_argument("--rate", type=float, default=8.0, help="online: requests per second")
    ap.add_argument("--reps", type=int, default=3, help="timed runs after the warm-up")
    ap.add_argument("--passes", type=int, default=1,
                    help="engine starts per backend, the backends' order reversed in every "
                         "second pass (the bound stays first); each pass's timed runs are "
                         "pooled into the backend's medians")  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--gpu-mem", type=float, default=0.85,
                    help="vLLM gpu_memory_utilization / SGLang mem_fraction_static")  # fmt: skip
    ap.add_argument("--capture-sizes", default="default",
                    help="vLLM CUDA graph batch sizes, e.g. 1,2,4,8,16,32,64,128,256 (shorter "
                         "start); default: vLLM's own list")  # fmt: skip
    ap.add_argument("--budget", type=float, default=540.0, help="seconds for all backends")
    ap.add_argument(
        "--out", type=Path, help=f"result JSON (default {RESULTS}/serving_ENGINE_MODE.json)"
    )
    ap.add_argument("--profile", type=Path, metavar="DIR",
                    help="profile one more run of each workload (offline or online, as "
                         "--mode) into DIR/BACKEND and summarize the traces")  # fmt: skip
    ap.add_argument("--profile-steps", type=int, default=200, metavar="N",
                    help="with --profile: trace the profiled run's first N engine steps (0: "
                         "the whole run, whose trace can take minutes to write)")  # fmt: skip
    ap.add_argument("--dry-run", action="store_true",
                    help="print the plan (backends, workloads, sizes, commands) and exit")  # fmt: skip
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    known = BACKENDS[args.engine] + FLOORS[args.engine]
    args.backends = args.backends or list(BACKENDS[args.engine])
    bases = check_variants(ap, args.backends, ours="prefixattn")
    bad = [b for b, base in zip(args.backends, bases, strict=True) if base not in known]
    if bad:
        ap.error(f"unknown backend(s) for {args.engine}: {' '.join(bad)} "
                 f"(choose from {' '.join(known)})")  # fmt: skip
    if len(set(args.backends)) != len(args.backends):
        ap.error("--backends lists a backend twice")
    # The bound first: every later backend's percentage is known as soon as it finishes.
    args.backends = sorted(args.backends, key=lambda b: b != BOUND)
    try:
        args.sizes = parse_sizes(args.size)
    except ValueError as e:
        ap.error(str(e))
    if args.reps < 1:
        ap.error("--reps must be at least 1")
    if args.passes < 1:
        ap.error("--passes must be at least 1")
    if args.rate <= 0:
        ap.error("--rate must be positive")
    if args.profile is not None and args.passes > 1:
        ap.error("--profile takes one pass (each pass would profile into the same folder)")
    if args.profile_steps < 0:
        ap.error("--profile-steps must be 0 (the whole run) or positive")
    if args.out is None:
        args.out = RESULTS / f"serving_{args.engine}_{args.mode}.json"
    return args


def worker_cmd(args: argparse.Namespace, backend: str, model: str, result: Path) -> list[str]:
    sizes = [x for s in args.size for x in ("--size", s)]
    return [
        sys.executable, "-m", "tools.serving.bench", "--worker", backend, "--model", model,
        "--result", str(result), "--engine", args.engine, "--mode", args.mode,
        "--workloads", *args.workloads, *sizes, "--rate", str(args.rate),
        "--reps", str(args.reps), "--seed", str(args.seed),
        "--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs),
        "--gpu-mem", str(args.gpu_mem), "--capture-sizes", args.capture_sizes,
        *(["--profile", str(args.profile.resolve()), "--profile-steps", str(args.profile_steps)]
          if args.profile else []),
    ]  # fmt: skip


def worker_env(args: argparse.Namespace, backend: str, scratch: Path) -> dict[str, str]:
    """The engine variables a backend's worker gets (only those; the rest is inherited)."""
    if args.engine == "vllm":
        # FlashInfer's sampler needs a JIT build of minutes without its precompiled kernels;
        # vLLM's PyTorch sampler serves every backend alike.
        env = {"VLLM_USE_FLASHINFER_SAMPLER": "0"}
        if args.mode == "offline":
            return {**env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        return {**env, "VLLM_WORKER_MULTIPROC_METHOD": "fork"}
    from tools.sglang.core_options import engine_env

    full = engine_env(backend, scratch, bound=backend == BOUND, read_floor=backend == READ_FLOOR)
    if args.profile is not None:
        from tools.sglang.stepmark import plugin_env

        full = plugin_env(scratch / "stepmark", full)  # None: on this process's environment
    return {k: v for k, v in (full or {}).items() if os.environ.get(k) != v}


def gpu_name() -> str | None:
    """The first GPU's name from nvidia-smi (this process never initializes CUDA)."""
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=True,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    names = done.stdout.strip().splitlines()
    return names[0].strip() if names else None


def percent_of_bound(results: dict[str, dict[str, Any]], metric: str = METRIC) -> None:
    """Add ``pct_of_bound`` (the median ``metric`` as % of the bound's) to every backend's
    result of every workload where the bound has one. ``results``: workload -> backend ->
    summary (``{metric: {"median": ...}}``). Example: bound 1000, prefixattn 870 -> 87.0."""
    for per in results.values():
        bound = per.get(BOUND, {}).get(metric, {}).get("median")
        for r in per.values():
            value = r.get(metric, {}).get("median")
            if bound and value is not None:
                r["pct_of_bound"] = round(100 * value / bound, 1)


def markdown(result: dict[str, Any]) -> str:
    """Tables for docs/performance.md: median output tokens/s (% of the bound) per workload
    and backend; online, also TTFT and inter-token latency p50 / p99."""
    backends = list(result["backends"])
    per = result["results"]
    head = "| workload | " + " | ".join(backends) + " |\n|---|" + "---:|" * len(backends) + "\n"
    lines = [
        f"{result['engine_label']}, {result.get('gpu') or 'GPU unknown'}, {result['mode']}, "
        f"8B-Llama shape (dummy weights); median of "
        f"{result['config']['reps'] * result['config'].get('passes', 1)} runs, "
        "output tokens/s (% of the attention-free bound)",
        "",
        head.rstrip("\n"),
    ]

    def cell(r: dict[str, Any] | None) -> str:
        if not r or METRIC not in r:
            return "-"
        pct = f" ({r['pct_of_bound']:.0f}%)" if "pct_of_bound" in r else ""
        cut = f" [{r['reps']} runs]" if r.get("partial") else ""  # the worker was cut off
        return f"{r[METRIC]['median']:,.0f}{pct}{cut}"

    for w, rs in per.items():
        lines.append(f"| {w} | " + " | ".join(cell(rs.get(b)) for b in backends) + " |")
    if result["mode"] == "online":
        for name, label in (("ttft_ms", "time to first token"), ("itl_ms", "inter-token latency")):
            lines += ["", f"{label}, ms, p50 / p99 (medians over runs)", "", head.rstrip("\n")]
            for w, rs in per.items():
                cells = []
                for b in backends:
                    r = rs.get(b) or {}
                    if f"{name}_p50" in r:
                        cells.append(
                            f"{r[f'{name}_p50']['median']:.1f} / {r[f'{name}_p99']['median']:.1f}"
                        )
                    else:
                        cells.append("-")
                lines.append(f"| {w} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], out: Path) -> None:
    """Bars: each backend's median output tokens/s as % of the bound, per workload (the
    tokens/s themselves when the bound has no result at all)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(result["results"])
    per = result["results"]
    relative = any(BOUND in per[w] and METRIC in per[w][BOUND] for w in workloads)
    backends = [b for b in result["backends"] if b != BOUND or not relative]

    def value(r: dict[str, Any]) -> float:
        if relative:
            return r.get("pct_of_bound", 0.0)
        return r.get(METRIC, {}).get("median", 0.0)

    fig, ax = plt.subplots(figsize=(max(6.0, 1.4 * len(workloads) + 2), 4))
    width = 0.8 / max(len(backends), 1)
    for i, b in enumerate(backends):
        xs = [k + i * width for k in range(len(workloads))]
        ys = [value(per[w].get(b, {})) for w in workloads]
        bars = ax.bar(xs, ys, width, label=b, color=f"C{i}")
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    if relative:
        ax.axhline(100, color="gray", linewidth=0.8, linestyle="--")
    ax.set_xticks([k + width * (len(backends) - 1) / 2 for k in range(len(workloads))])
    ax.set_xticklabels(workloads)
    ax.set_ylabel("output tokens/s, % of the attention-free bound" if relative
                  else "output tokens/s (no bound result)")  # fmt: skip
    ax.set_title(f"{result['engine_label']}, {result.get('gpu') or ''}, {result['mode']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def collect(args: argparse.Namespace, runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The report from every worker's result: ``runs[backend]`` as the parent recorded it."""
    names = expand_names(args.workloads, args.sizes)
    engine = "vLLM" if args.engine == "vllm" else "SGLang"
    version = installed_version(args.engine)
    result: dict[str, Any] = {
        "engine": args.engine,
        "engine_label": f"{engine} {version}" if version else engine,
        "versions": {p: installed_version(p) for p in (args.engine, "prefixattn", "torch")},
        "gpu": getattr(args, "gpu", None),
        "mode": args.mode,
        "model": "Llama-3-8B shape, dummy weights, bf16",
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
                   if k not in ("worker", "model", "result", "sizes", "size", "dry_run")},
        "sizes": {w: args.sizes[w] for w in args.workloads},
        "workloads": {w.name: w.describe() for n in args.workloads
                      for w in build(n, args.sizes, args.seed)},
        "backends": {
            b: {k: v for k, v in runs.get(b, {"not_run": True}).items() if k != "workloads"}
            for b in args.backends
        },
        "results": {},
    }  # fmt: skip
    for w in names:
        per = {b: r["workloads"][w] for b, r in runs.items() if w in r.get("workloads", {})}
        result["results"][w] = per
    percent_of_bound(result["results"])
    return result


def unavailable(engine: str, backend: str, env: dict[str, str] | None = None) -> str | None:
    """Why ``backend`` cannot run in ``engine``'s environment (``env``, default this
    process's): the last line of its :data:`PREFLIGHT` import's error; None where the import
    works or the backend has none."""
    statement = PREFLIGHT.get((engine, backend.split("+")[0]))
    if statement is None:
        return None
    try:
        done = subprocess.run(
            [sys.executable, "-c", statement], capture_output=True, text=True, timeout=120,
            env=env,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return f"{statement!r} did not finish in 120 s"
    if done.returncode == 0:
        return None
    lines = (done.stderr or done.stdout).strip().splitlines()
    return f"{statement!r} failed: {lines[-1] if lines else f'exit {done.returncode}'}"


COUNTS_MARK = "prefixattn step planner counts: "


def planner_counts(log: Path) -> dict[str, Any] | None:
    """The last counts a prefixattn planner logged into ``log`` (``StepOptions.
    count_fallbacks``, the ``+count_fallbacks`` variant: plan kinds, hint rows, host
    milliseconds per plan, fallbacks), or None. Each of an engine's planners logs its own;
    the last line is the latest of one of them."""
    import ast

    if not log.exists():
        return None
    last = None
    for line in log.read_text(errors="replace").splitlines():
        at = line.find(COUNTS_MARK)
        if at >= 0:
            last = line[at + len(COUNTS_MARK) :].strip()
    if last is None:
        return None
    try:
        value = ast.literal_eval(last)
    except (ValueError, SyntaxError):
        return None
    return value if isinstance(value, dict) else None


def pass_order(backends: list[str], passes: int) -> list[str]:
    """The backends' runs, one engine start each: every pass runs them all, every second
    pass in reverse order (the bound first in each), so no backend always runs first.
    Example: [bound, A, B], 2 passes -> bound A B bound B A."""
    rest = [b for b in backends if b != BOUND]
    head = [b for b in backends if b == BOUND]
    return [b for k in range(passes) for b in head + (rest[::-1] if k % 2 else rest)]


FIRST_START_SHARES = 1.6
"""The first engine start of a call compiles what later ones find cached (vLLM's
``torch.compile`` artifacts, Triton kernels): on a fresh H200 (2026-11-29) vLLM's first starts
took 106 and 87 s, the same engines' second starts 41 and 71 s. The first run's share of the
budget counts as this many of the others'."""


def budget_share(left: float, i: int, n: int) -> float:
    """Seconds for engine run ``i`` of ``n`` when ``left`` seconds remain: an even share of
    what is left, the first run counting :data:`FIRST_START_SHARES` shares. A run that ends
    early leaves its time to the later ones. Example: 600 s, 4 runs -> 208.7 s for the first,
    then (600 - its time) / 3 each."""
    weight = FIRST_START_SHARES if i == 0 else 1.0
    return left * weight / (weight + n - i - 1)


def pool_passes(first: dict[str, Any], later: dict[str, Any]) -> dict[str, Any]:
    """One backend's result over two engine starts: each workload's timed runs of both
    (its medians over all of them), the start of the first, finished only if both did."""
    from tools.serving.engines import summarize_reps

    out = {**first, "workloads": dict(first.get("workloads", {}))}
    later_workloads = later.get("workloads", {})
    for w in out["workloads"]:
        if w not in later_workloads:  # the later pass never reached it: fewer runs
            out["workloads"][w] = {**out["workloads"][w], "partial": True}
    for w, summary in later_workloads.items():
        before = out["workloads"].get(w)
        runs = (before or {}).get("runs", []) + summary.get("runs", [])
        if not runs:
            continue
        out["workloads"][w] = {
            **summarize_reps(runs), "runs": runs,
            "cache_resets_ok": all(
                r.get("cache_resets_ok", True) for r in (before or {}, summary)
            ),
        }  # fmt: skip
        if before is None or summary.get("partial") or before.get("partial"):
            out["workloads"][w]["partial"] = True  # fewer runs than the passes would give
    out["passes"] = [*first.get("passes", [_pass_info(first)]), _pass_info(later)]
    out["finished"] = bool(first.get("finished")) and bool(later.get("finished"))
    for key in ("error", "log_tail", "skipped"):
        if key in later:
            out[key] = later[key]
    return out


def _pass_info(data: dict[str, Any]) -> dict[str, Any]:
    keys = ("exit", "wall_s", "engine_start_s", "finished", "log", "planner_counts")
    return {k: data[k] for k in keys if k in data}


def run_backend(
    args: argparse.Namespace, backend: str, model: str, timeout: float, tag: str = ""
) -> dict:
    missing = unavailable(args.engine, backend)
    if missing is not None:
        print(f"{backend}: skipped, {missing}", flush=True)
        return {"finished": False, "skipped": missing, "error": f"skipped: {missing}"}
    scratch = Path(tempfile.mkdtemp(prefix=f"serving-{backend}-"))
    out_dir = args.out.parent
    result = scratch / "result.json"
    log = out_dir / f"{args.out.stem}_{backend}{tag}.log"
    env = {**os.environ, **worker_env(args, backend, scratch)}
    t0 = time.monotonic()
    code = run_in_group(worker_cmd(args, backend, model, result), timeout, log, env)
    wall = round(time.monotonic() - t0, 1)
    data: dict[str, Any] = json.loads(result.read_text()) if result.exists() else {}
    data.update(exit=code, wall_s=wall, log=str(log))
    counts = planner_counts(log)
    if counts is not None:
        data["planner_counts"] = counts
    if args.profile is not None and (args.profile / backend).exists():
        from tools.trace_summary import summarize_traces

        data["profile"] = summarize_traces(
            args.profile / backend, step_marker=STEP_MARKER[args.engine]
        )
    data.setdefault("finished", False)
    if code != 0 and not data["finished"]:
        tail = log.read_text(errors="replace").strip().splitlines()[-20:]
        data["error"] = f"exited {code} after {wall} s"
        data["log_tail"] = tail
    print(f"{backend}: exit {code} after {wall} s (log {log})", flush=True)
    return data


def dry_run(args: argparse.Namespace) -> None:
    print(f"engine {args.engine}, mode {args.mode}, backends {' '.join(args.backends)}")
    print(f"budget {args.budget:.0f} s, {args.reps} timed runs + 1 warm-up per workload")
    if args.passes > 1:
        print(f"{args.passes} passes: {' '.join(pass_order(args.backends, args.passes))}")
    for name in args.workloads:
        print(f"{name}: sizes {json.dumps(args.sizes[name])}")
        for w in build(name, args.sizes, args.seed):
            print(f"  {w.name}: {json.dumps(w.describe())}")
    scratch = Path(tempfile.gettempdir()) / "serving-dry-run"
    for b in args.backends:
        env = worker_env(args, b, scratch)
        cmd = worker_cmd(args, b, "MODEL_DIR", scratch / b / "result.json")
        prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
        print(f"{b}: {prefix + ' ' if prefix else ''}{shlex.join(cmd)}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        from tools.serving.engines import run_worker

        path = Path(args.result)
        run_worker(args, lambda d: write_atomic(path, d))
        return 0
    if args.dry_run:
        dry_run(args)
        return 0

    # A SIGTERM (e.g. from `timeout`) unwinds through run_in_group's cleanup.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    deadline = time.monotonic() + args.budget
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.gpu = gpu_name()
    from tools.vllm.bench_decode import write_model

    model = Path(tempfile.mkdtemp()) / "llama8b-shape"
    write_model(model, args.max_model_len)
    runs: dict[str, dict[str, Any]] = {}
    order = pass_order(args.backends, args.passes)
    for i, backend in enumerate(order):
        timeout = budget_share(deadline - time.monotonic(), i, len(order))
        tag = f"-pass{order[:i].count(backend) + 1}" if backend in runs else ""
        data = run_backend(args, backend, str(model), timeout, tag)
        runs[backend] = pool_passes(runs[backend], data) if backend in runs else data
        result = collect(args, runs)
        args.out.write_text(json.dumps(result, indent=1))
    table = markdown(result)
    args.out.with_suffix(".md").write_text(table)
    try:
        plot(result, args.out.with_suffix(".png"))
    except ImportError as e:  # matplotlib is the bench extra's
        print(f"no plot: {e}", flush=True)
    print("\n" + table, flush=True)
    print(f"results: {args.out} (.md, .png)", flush=True)
    return 0 if all(r.get("finished") for r in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
