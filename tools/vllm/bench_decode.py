"""End-to-end decode step time in vLLM: CUSTOM (prefixattn) against FLASHINFER and FLASH_ATTN.

For vLLM 0.26.0-0.33.0 (the GPU runs use 0.33.0); the result records the version it ran.

An 8B-Llama-shaped model (32 layers, hidden 4096, 32/8 heads, head_dim 128, intermediate 14336,
vocab 128256) with dummy weights: only a config.json, written with transformers' LlamaConfig.
Workloads, each B requests (``--batches``, up to 256) of token-id prompts:

- ``shared1``: one P-token prefix (``--prefix``, default 4096) shared by all, private tails of
  ``--tail`` (64) tokens;
- ``tree``: three levels: a P/2 root shared by all, 4 children of P/4, 16 grandchildren of P/4,
  then the private tail;
- ``none``: nothing shared, ``--none-len`` (1024) private tokens each (B x 4096 private tokens
  would not fit in an 80 GB GPU's KV cache).

``--backends`` may also name ``NOATTN``, the attention-free bound (``tools/vllm/noattn.py``:
FLASH_ATTN's metadata path, no KV reads or writes, no attention math). Its backend is
registered in the worker process, so with it in the run every backend's engine core runs in
its worker process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), alike. ``PREFIXFLOOR`` is the bound
plus the shared prefix's attention math on FA3 (``tools/prefix_floor.py``), with
``--workloads shared1`` only (its prefix is ``--prefix``). A backend name may carry
options after ``+`` (``CUSTOM+split_waves``; ``tools/variants.py``), passed as
``additional_config={"prefixattn": ...}``.

Prefix caching is on (vLLM's default), so a shared prefix is stored once. Decode step time, per
workload: one generation with ``max_tokens=1`` stores every prompt in the prefix cache; then
greedy generations with ``max_tokens=N1`` and ``N2`` (``ignore_eos``), timed alternately
``--reps`` (5) times, prefill only the last tokens of each prompt, the same in both; step =
the median over pairs of (t(N2) - t(N1)) / (N2 - N1), with the pairs' min and max in
``step_spread_ms`` (``tools/timing.py``). All B requests decode together in every step.
Each N2 generation also gives the step from the engine's own per-request timestamps (first
to last output token; ``tools.timing.inter_token_ms``; every backend's engine logs stats
for them, alike):
``itl_ms``, the median over the repetitions with their min and max, free of the
generations' admission and prefill.

Each backend runs in its own subprocess (vLLM engines do not reliably free GPU memory inside
one process), with vLLM's default compilation and CUDA graph mode (``FULL_AND_PIECEWISE``);
``--capture-sizes`` trims the captured batch sizes to shorten engine start (default
1,2,4,8,16,32,64,128,256; ``default`` keeps vLLM's list). The backends share ``--budget``
seconds; a worker writes its results after every workload, so a timeout keeps what finished.

    python -m tools.vllm.bench_decode --out bench.json [--batches 64 256] [--prefix 4096]

``--profile DIR`` also records one more generation per workload with vLLM's torch profiler
(outside the timed runs) and adds each trace's summary (GPU idle time, its longest gaps, the
adapter's host ranges; ``tools/trace_summary.py``) to the results.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tools import RESULTS, installed_version, write_atomic
from tools.proc_group import run_in_group
from tools.timing import inter_token_ms, paired_step_ms
from tools.trace_summary import summarize_traces
from tools.variants import check_variants, parse_variant

BACKENDS = ("CUSTOM", "FLASH_ATTN", "FLASHINFER")
BOUND = "NOATTN"
"""The attention-free bound (``tools/vllm/noattn.py``), run when named in ``--backends``."""
FLOOR = "PREFIXFLOOR"
"""The bound plus the shared prefix's math on FA3 (``tools/prefix_floor.py``)."""
PROFILE_TOKENS = 12
WORKLOADS = ("shared1", "tree", "none")


def write_model(path: Path, max_len: int) -> None:
    from transformers import LlamaConfig

    shape: dict[str, Any] = dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=max_len,
        rope_theta=500000.0, rms_norm_eps=1e-5, torch_dtype="bfloat16", tie_word_embeddings=False,
    )  # fmt: skip
    cfg = LlamaConfig(**shape)
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(path)


def workload(kind: str, batch: int, prefix: int, tail: int, none_len: int) -> list[list[int]]:
    rng = random.Random(1000 * WORKLOADS.index(kind) + batch)

    def toks(n: int) -> list[int]:
        return [rng.randrange(10, 120000) for _ in range(n)]

    if kind == "shared1":
        root = toks(prefix)
        return [root + toks(tail) for _ in range(batch)]
    if kind == "tree":
        root = toks(prefix // 2)
        mids = [toks(prefix // 4) for _ in range(4)]
        lows = [toks(prefix // 4) for _ in range(16)]
        return [root + mids[(i % 16) // 4] + lows[i % 16] + toks(tail) for i in range(batch)]
    if kind == "none":
        return [toks(none_len) for _ in range(batch)]
    raise ValueError(kind)


def worker_info(worker: Any) -> dict:
    """Runs in the engine's worker: resolved CUDA graph mode, graphs, CUSTOM builders' state."""
    info: dict[str, Any] = {}
    try:
        runner = worker.model_runner
        info["cudagraph_mode"] = str(worker.vllm_config.compilation_config.cudagraph_mode)
        graphs = getattr(getattr(runner, "cudagraph_manager", None), "graphs", None)
        if graphs is not None:
            info["full_graphs_captured"] = len(graphs)
        for groups in getattr(runner, "attn_groups", None) or []:
            for group in groups:
                b = group.get_metadata_builder(0)
                info["builder"] = type(b).__name__
                if hasattr(b, "full_graphs"):
                    info["full_graphs"] = b.full_graphs
                    info["captured_generation"] = b.graph.captured_generation
                    info["buffers_generation"] = b.attention.buffers_generation
                    info["plan_kinds"] = dict(getattr(b, "plan_kinds", {}))
    except Exception as e:  # report, never fail the run here
        info["error"] = f"{type(e).__name__}: {e}"
    return info


def run_worker(args: argparse.Namespace) -> None:
    """One backend, in this process; writes ``args.result`` after every workload."""
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc with a function
    # Greedy decoding needs no FlashInfer sampler, whose JIT build (minutes, without
    # FlashInfer's precompiled kernels) would eat the engine's time; every backend alike.
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    if args.in_process:
        # The engine core in this process, where the bound's backend is registered (every
        # backend of the run alike, so the step times compare).
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if args.worker == BOUND:
        from tools.vllm.noattn import register

        register()
    elif args.worker == FLOOR:
        from tools.vllm.noattn import register_floor

        register_floor(args.prefix)
    from vllm import LLM, SamplingParams, TokensPrompt

    compilation: dict[str, Any] = {}
    if args.capture_sizes != "default":
        compilation["cudagraph_capture_sizes"] = [int(x) for x in args.capture_sizes.split(",")]
    profiler: dict[str, Any] | None = None
    if args.profile:
        profiler = {"profiler": "torch", "ignore_frontend": True, "torch_profiler_with_stack": False,
                    "torch_profiler_dir": str(Path(args.profile).resolve() / args.worker)}  # fmt: skip
    backend, changes = parse_variant(args.worker)
    extra = {"additional_config": {"prefixattn": changes}}
    t0 = time.perf_counter()
    llm = LLM(
        model=args.model, load_format="dummy", skip_tokenizer_init=True,
        attention_backend=backend, gpu_memory_utilization=args.gpu_mem,
        max_model_len=args.max_model_len, max_num_seqs=max(args.batches),
        enable_prefix_caching=True, seed=0, compilation_config=compilation or None,
        profiler_config=profiler, disable_log_stats=False, **(extra if changes else {}),
    )  # fmt: skip
    out: dict[str, Any] = {"engine_start_s": round(time.perf_counter() - t0, 1), "step_ms": {}}
    out["info"] = llm.collective_rpc(worker_info)[0]
    write_atomic(Path(args.result), out)
    print(args.worker, json.dumps(out), flush=True)

    itls: list[float] = []

    def timed(prompts: list[Any], n: int) -> float:
        sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)
        t = time.perf_counter()
        outputs = llm.generate(prompts, sp, use_tqdm=False)
        took = time.perf_counter() - t
        if n == args.n2:
            itl = inter_token_ms(outputs)
            if itl is not None:
                itls.append(itl)
        return took

    for batch in args.batches:
        for kind in args.workloads:
            ids = workload(kind, batch, args.prefix, args.tail, args.none_len)
            prompts = [TokensPrompt(prompt_token_ids=p) for p in ids]
            warm = timed(prompts, 1)  # prefill once: prompts stored in the prefix cache
            t1s, t2s = [], []
            itls.clear()
            for _ in range(args.reps):  # alternating, so that a drift spreads over both
                t1s.append(timed(prompts, args.n1))
                t2s.append(timed(prompts, args.n2))
            step = paired_step_ms(t1s, t2s, args.n1, args.n2)
            step_ms = step["median"]
            out["step_ms"].setdefault(kind, {})[str(batch)] = step_ms
            out.setdefault("step_spread_ms", {})[f"{kind}/{batch}"] = step
            if itls:
                out.setdefault("itl_ms", {})[f"{kind}/{batch}"] = {
                    "median": round(statistics.median(itls), 3), "min": round(min(itls), 3),
                    "max": round(max(itls), 3),
                }  # fmt: skip
            out.setdefault("raw_s", {})[f"{kind}/{batch}"] = {
                "warm": round(warm, 4), "n1": [round(x, 4) for x in t1s],
                "n2": [round(x, 4) for x in t2s],
            }  # fmt: skip
            itl = out.get("itl_ms", {}).get(f"{kind}/{batch}")
            print(
                f"{args.worker} {kind} B={batch}: decode step {step_ms:.2f} ms "
                f"(pairs {step['min']:.2f}-{step['max']:.2f})"
                + (f"; between tokens {itl['median']:.2f} ms" if itl else ""),
                flush=True,
            )
            write_atomic(Path(args.result), out)
            if args.profile:  # a separate, profiled generation: never in the timings above
                llm.start_profile(f"{kind}-B{batch}")
                timed(prompts, PROFILE_TOKENS)
                llm.stop_profile()
    out["info_after"] = llm.collective_rpc(worker_info)[0]
    write_atomic(Path(args.result), out)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(RESULTS / "vllm_bench_decode.json"),
                    help=f"result JSON (default {RESULTS}/vllm_bench_decode.json)")  # fmt: skip
    ap.add_argument("--backends", nargs="+", default=list(BACKENDS))
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    ap.add_argument("--batches", nargs="+", type=int, default=[256])
    ap.add_argument("--prefix", type=int, default=4096)
    ap.add_argument("--tail", type=int, default=64)
    ap.add_argument("--none-len", type=int, default=1024)
    ap.add_argument("--n1", type=int, default=8)
    ap.add_argument("--n2", type=int, default=104)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--gpu-mem", type=float, default=0.85)
    ap.add_argument("--capture-sizes", default="1,2,4,8,16,32,64,128,256")
    ap.add_argument("--budget", type=float, default=540.0, help="seconds for all backends")
    ap.add_argument("--profile", metavar="DIR",
                    help="after each timing, profile one more generation of "
                         f"{PROFILE_TOKENS} tokens into DIR/BACKEND and summarize the traces "
                         "(tools/trace_summary.py)")  # fmt: skip
    ap.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        run_worker(args)
        return 0

    check_variants(ap, args.backends, ours="CUSTOM")
    if FLOOR in args.backends and args.workloads != ["shared1"]:
        ap.error(f"{FLOOR} runs --workloads shared1 only (one shared prefix)")
    # A SIGTERM (run_gpu.sh's timeout) unwinds through run_in_group's cleanup.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    deadline = time.monotonic() + args.budget
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    model = Path(tempfile.mkdtemp()) / "llama8b-shape"
    write_model(model, args.max_model_len)
    results: dict[str, Any] = {
        "model": "Llama-3-8B shape, dummy weights, bf16",
        "engine_version": installed_version("vllm"),
        "config": {k: v for k, v in vars(args).items() if k not in ("worker", "model", "result")},
        "step_ms": {},
        "engine": {},
    }
    forwarded = [
        "--batches", *map(str, args.batches), "--workloads", *args.workloads,
        "--prefix", str(args.prefix), "--tail", str(args.tail),
        "--none-len", str(args.none_len), "--n1", str(args.n1), "--n2", str(args.n2),
        "--reps", str(args.reps), "--max-model-len", str(args.max_model_len),
        "--gpu-mem", str(args.gpu_mem), "--capture-sizes", args.capture_sizes,
        *(["--profile", args.profile] if args.profile else []),
        *(["--in-process"] if {BOUND, FLOOR} & set(args.backends) else []),
    ]  # fmt: skip
    for i, backend in enumerate(args.backends):
        timeout = (deadline - time.monotonic()) / (len(args.backends) - i)
        result = Path(tempfile.mkdtemp()) / f"{backend}.json"
        cmd = [sys.executable, "-m", "tools.vllm.bench_decode", "--worker", backend,
               "--model", str(model), "--result", str(result), *forwarded]  # fmt: skip
        t0 = time.monotonic()
        code = run_in_group(cmd, timeout)
        data = json.loads(result.read_text()) if result.exists() else {}
        results["step_ms"][backend] = data.pop("step_ms", {})
        # The worker's last write (``info_after``) comes after every measurement: an engine
        # that then overruns its time in shutdown still measured everything.
        finished = "info_after" in data
        results["engine"][backend] = {
            "exit": code, "finished": finished, "wall_s": round(time.monotonic() - t0, 1),
            **data,
        }  # fmt: skip
        late = " (after its last measurement)" if finished and code != 0 else ""
        print(f"{backend}: exit {code}{late}", flush=True)
        Path(args.out).write_text(json.dumps(results, indent=1))
    # Speed-up of CUSTOM over each other backend, per workload and batch.
    custom = results["step_ms"].get("CUSTOM", {})
    results["speedup_vs"] = {
        b: {
            kind: {
                bs: round(ms / custom[kind][bs], 3)
                for bs, ms in per.items()
                if custom.get(kind, {}).get(bs, 0) > 0
            }
            for kind, per in results["step_ms"][b].items()
        }
        for b in results["step_ms"]
        if b != "CUSTOM"
    }
    bound = results["step_ms"].get(BOUND, {})
    results["pct_of_bound"] = {
        b: {
            kind: {bs: round(100 * bound[kind][bs] / ms, 1) for bs, ms in per.items()
                   if ms > 0 and bound.get(kind, {}).get(bs)}
            for kind, per in results["step_ms"][b].items()
        }
        for b in results["step_ms"] if b != BOUND and bound
    }  # fmt: skip
    if args.profile:
        results["profile"] = summarize_traces(Path(args.profile), step_marker="cudaGraphLaunch")
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(json.dumps(results["step_ms"]), flush=True)
    complete = all(
        results["engine"][b]["finished"] and results["step_ms"][b] for b in args.backends
    )
    return 0 if complete else 1


if __name__ == "__main__":
    sys.exit(main())
