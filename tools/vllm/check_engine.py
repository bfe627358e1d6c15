"""GPU check: vLLM's offline engine with ``attention_backend="CUSTOM"`` against ``FLASH_ATTN``.

Saves a small Llama with random weights (std 0.02) via transformers, then runs the same
multi-level shared-prefix prompts (token ids, no tokenizer) through both backends, with CUDA
graphs (vLLM's default compilation: ``FULL_AND_PIECEWISE``) and with ``enforce_eager=True``,
greedy, 5 logprobs each. Requests stop after 8, 16 or 24 tokens, so the decode batch shrinks
25 -> 17 -> 9 and is replayed from different captured sizes (32, 24, 16 with vLLM's default
sizes), each with padding. Every engine runs in its own subprocess (an engine's GPU memory is
only reliably freed when its process ends), under a share of ``--budget`` seconds.

Mode ``spec`` runs both backends with speculative decoding (vLLM's ``ngram`` proposer, 3
draft tokens, default graphs): verification batches then reach attention with query lengths
up to 4 beside single-token decodes. Each leaf prompt ends with a repeat of 8 tokens from
earlier in the prompt, so the proposer drafts from the first decode step on. Both backends
run the same speculative scheme; the check passes only if CUSTOM's engine counted draft
tokens (vLLM's ``spec_decode`` metrics), so batches with longer queries did run.

Each engine's worker reports (through ``collective_rpc``) the CUDA graph mode vLLM resolved
and, for CUSTOM, its builders' state: with graphs on, CUSTOM passes only if vLLM kept full
decode graphs and the backend's attention was captured in them (``captured_generation`` set).

Pass criteria, per request: the greedy tokens agree up to the first position where FLASH_ATTN's
top-2 logprobs are within ``2 * TOL`` (a near tie that bf16 rounding may legally flip; after a
flip the continuations differ), and the chosen tokens' logprobs agree within ``TOL`` up to there.
``TOL = 0.05``: both backends compute in bf16 with fp32 accumulation, and at this scale the
logprob differences between two correct bf16 attention kernels (different summation orders)
stay well below that, while a wrong mask, scale or page stays far above it.

    python -m tools.vllm.check_engine [--out DIR] [--modes cudagraphs eager spec] [--budget S]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tools import RESULTS
from tools.proc_group import run_in_group

TOL = 0.05
BACKENDS = ("FLASH_ATTN", "CUSTOM")


def save_model(path: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, head_dim=128, vocab_size=8192, max_position_embeddings=8192,
        initializer_range=0.02, torch_dtype="bfloat16",
    )  # fmt: skip
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path)


def prompts(seed: int = 0, echo: bool = False) -> list[list[int]]:
    """Three-level forest: 2 roots of 700 tokens, 3 children of 300 each, 4 leaves of 1-90.

    With ``echo`` each leaf ends with a copy of 8 tokens from earlier in its prompt, so an
    n-gram proposer finds a match (and drafts the tokens that followed it) at once."""
    rng = random.Random(seed)
    out = []
    for _ in range(2):
        root = [rng.randrange(1, 8000) for _ in range(700)]
        for _ in range(3):
            child = root + [rng.randrange(1, 8000) for _ in range(300)]
            for _ in range(4):
                leaf = child + [rng.randrange(1, 8000) for _ in range(rng.randint(1, 90))]
                out.append(with_echo(rng, leaf) if echo else leaf)
    out.append([rng.randrange(1, 8000) for _ in range(33)])  # shares nothing
    return out


def with_echo(rng: random.Random, prompt: list[int]) -> list[int]:
    """``prompt`` followed by a copy of 8 of its earlier tokens: an n-gram proposer matches
    them and drafts from the first decode step."""
    at = rng.randrange(0, max(1, len(prompt) - 16))
    return prompt + prompt[at : at + 8]


def no_drafts(counts: dict[str, int]) -> str:
    """Why a speculative run proves nothing about longer queries ('' if its engine drafted)."""
    return "" if counts.get("num_draft_tokens") else f"CUSTOM's engine drafted no tokens: {counts}"


SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
        "prompt_lookup_min": 2}  # fmt: skip


def spec_counts(llm: Any) -> dict[str, int]:
    """vLLM's speculative-decoding counters of this engine (drafts, draft and accepted tokens)."""
    out: dict[str, int] = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode_num") and hasattr(m, "value"):
            key = m.name.removeprefix("vllm:spec_decode_")
            out[key] = out.get(key, 0) + int(m.value)
    return out


def worker_info(worker: Any) -> dict:
    """Runs in the engine's worker: the resolved CUDA graph mode and the attention builders."""
    info: dict[str, Any] = {}
    try:
        runner = worker.model_runner
        info["runner"] = type(runner).__name__
        info["cudagraph_mode"] = str(worker.vllm_config.compilation_config.cudagraph_mode)
        graphs = getattr(getattr(runner, "cudagraph_manager", None), "graphs", None)
        if graphs is not None:
            info["full_graphs_captured"] = len(graphs)
        builders = []
        for groups in getattr(runner, "attn_groups", None) or []:
            for group in groups:
                b = group.get_metadata_builder(0)
                entry: dict[str, Any] = {"builder": type(b).__name__}
                if hasattr(b, "full_graphs"):
                    entry["full_graphs"] = b.full_graphs
                    entry["max_graph_tokens"] = b.max_graph_tokens
                    entry["captured_generation"] = b.graph.captured_generation
                    entry["delegated_captures"] = getattr(b, "delegated_captures", 0)
                    entry["buffers_generation"] = b.attention.buffers_generation
                    entry["plan_kinds"] = dict(getattr(b, "plan_kinds", {}))
                builders.append(entry)
        info["builders"] = builders
    except Exception as e:  # report, never fail the run here
        info["error"] = f"{type(e).__name__}: {e}"
    return info


def full_decode_graphs(info: dict) -> bool:
    """Did vLLM keep full decode graphs, and were all CUSTOM builders captured in them? A
    builder whose every graph holds one token (``max_graph_tokens`` 1, e.g.
    ``max_num_seqs=1``) under ``delegate_unshared`` holds ``FLASH_ATTN``'s kernels there, and
    counts by its delegated captures; any larger graph must have been captured by
    prefixattn."""
    mode = info.get("cudagraph_mode", "")
    builders = [b for b in info.get("builders", []) if "full_graphs" in b]

    def captured(b: dict) -> bool:
        if b["captured_generation"] is not None:
            return True
        return b.get("max_graph_tokens") == 1 and b.get("delegated_captures", 0) > 0

    return (
        "FULL" in mode
        and bool(builders)
        and all(b["full_graphs"] and captured(b) for b in builders)
    )


def greedy_outputs(results: list[Any]) -> list[dict]:
    """Tokens and top logprobs (best first) of each of vLLM's ``RequestOutput``s."""
    return [
        {
            "tokens": list(c.token_ids),
            "logprobs": [
                sorted(((t, lp.logprob) for t, lp in step.items()), key=lambda x: -x[1])
                for step in c.logprobs or []
            ],
        }
        for c in (r.outputs[0] for r in results)
    ]


def generate(model: str, backend: str, mode: str) -> dict:
    """One engine, in this process: greedy tokens and top-5 logprobs of every prompt."""
    from vllm import LLM, SamplingParams, TokensPrompt

    # collective_rpc with a function needs pickle-based serialization.
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    extra: dict[str, Any] = {}
    if mode == "spec":
        extra = {"speculative_config": SPEC, "disable_log_stats": False}
    llm = LLM(
        model=model, skip_tokenizer_init=True, attention_backend=backend,
        enforce_eager=mode == "eager", gpu_memory_utilization=0.5, max_model_len=4096, seed=0,
        **extra,
    )  # fmt: skip
    ps = prompts(echo=mode == "spec")
    sp: dict[str, Any] = dict(temperature=0, logprobs=5, ignore_eos=True, detokenize=False)
    sps = [SamplingParams(max_tokens=8 + 8 * (i % 3), **sp) for i in range(len(ps))]
    out = greedy_outputs(llm.generate([TokensPrompt(prompt_token_ids=p) for p in ps], sps))
    info = llm.collective_rpc(worker_info)[0]
    if mode == "spec":
        info["spec_decode"] = spec_counts(llm)
    print(backend, mode, json.dumps(info), flush=True)
    return {"outputs": out, "info": info}


def compare(ref: list[dict], got: list[dict]) -> dict:
    worst, compared, flips = 0.0, 0, 0
    for a, b in zip(ref, got, strict=True):
        for i, (ta, tb) in enumerate(zip(a["tokens"], b["tokens"], strict=True)):
            top = a["logprobs"][i]
            near_tie = len(top) > 1 and top[0][1] - top[1][1] < 2 * TOL
            if ta != tb:
                if not near_tie:
                    return {"ok": False, "why": f"token mismatch at {i} without a near tie"}
                flips += 1
                break
            lb = dict(b["logprobs"][i])[tb]
            worst = max(worst, abs(top[0][1] - lb))
            compared += 1
            if near_tie:
                break
    return {"ok": worst <= TOL, "max_logprob_diff": worst, "tokens": compared, "flips": flips}


def run_one(model: str, backend: str, mode: str, out: Path, timeout: float) -> dict:
    """``generate`` in a subprocess; returns its result or an ``error``."""
    result = out / f"vllm_check_{backend}_{mode}.json"
    result.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "tools.vllm.check_engine",
        "--one",
        backend,
        mode,
        "--model",
        model,
        "--out",
        str(out),
    ]
    t0 = time.monotonic()
    code = run_in_group(cmd, timeout)
    wall = round(time.monotonic() - t0, 1)
    print(f"{backend} {mode}: exit {code} after {wall} s", flush=True)
    if code != 0 or not result.exists():
        return {"error": f"engine run exited {code} after {wall} s", "wall_s": wall}
    data = json.loads(result.read_text())
    data["wall_s"] = wall
    return data


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=RESULTS / "vllm-check",
                    help=f"folder for the results (default {RESULTS}/vllm-check)")  # fmt: skip
    ap.add_argument("--modes", nargs="+", choices=["cudagraphs", "eager", "spec"],
                    default=["cudagraphs", "eager"])  # fmt: skip
    ap.add_argument("--budget", type=float, default=480.0, help="seconds for all engine runs")
    ap.add_argument("--one", nargs=2, metavar=("BACKEND", "MODE"), help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.one:
        backend, mode = args.one
        data = generate(args.model, backend, mode)
        (args.out / f"vllm_check_{backend}_{mode}.json").write_text(json.dumps(data))
        return

    # A SIGTERM (run_gpu.sh's timeout) unwinds through run_in_group's cleanup.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    deadline = time.monotonic() + args.budget
    summary: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as d:
        save_model(Path(d))
        runs_left = 2 * len(args.modes)
        for mode in args.modes:
            res = {}
            for backend in BACKENDS:
                runs_left -= 1
                # All that is left, less 20 s for each later run: the first runs (graphs on,
                # which compile) get what they need, later ones what remains.
                timeout = max(deadline - time.monotonic() - 20 * runs_left, 30)
                res[backend] = run_one(d, backend, mode, args.out, timeout)
            ref, got = res["FLASH_ATTN"], res["CUSTOM"]
            if "error" in ref or "error" in got:
                result: dict[str, Any] = {
                    "ok": False,
                    "why": f"FLASH_ATTN: {ref.get('error', 'ok')}; CUSTOM: {got.get('error', 'ok')}",
                }
            else:
                result = compare(ref["outputs"], got["outputs"])
            result["info"] = {b: r.get("info") for b, r in res.items()}
            result["wall_s"] = {b: r["wall_s"] for b, r in res.items()}
            if mode == "cudagraphs" and "error" not in got:
                result["custom_full_decode_graphs"] = full_decode_graphs(got["info"])
                if not result["custom_full_decode_graphs"]:
                    result["ok"] = False
                    result.setdefault("why", "CUSTOM ran without full decode CUDA graphs")
            if mode == "spec" and "error" not in got:
                counts = got["info"].get("spec_decode", {})
                result["custom_spec_decode"] = counts
                if no_drafts(counts):
                    result["ok"] = False
                    result.setdefault("why", no_drafts(counts))
            summary[mode] = result
            print(mode, json.dumps(result), flush=True)
            (args.out / "vllm_check_engine.json").write_text(json.dumps(summary, indent=1))
    assert summary and all(v["ok"] for v in summary.values()), summary


if __name__ == "__main__":
    main()
