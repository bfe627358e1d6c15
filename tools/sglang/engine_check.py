"""GPU check: ``sglang.Engine(attention_backend="prefixattn")`` against SGLang's own backend,
with CUDA graphs on (SGLang's default: full decode graphs, breakable prefill graphs) and off
(``disable_cuda_graph=True``).

A small Llama with random weights (normal, std 0.02, so logits are not flat and attention
errors show) is saved with ``transformers``. Prompts form a three-level forest: 2 roots of
700 tokens, 3 children of 300 under each, 4 leaves of 1-90 tokens under each child, plus
one 33-token and one 1-token prompt that share nothing (26 requests). The roots and
children are put in the radix cache first, so the checked batch decodes over rows with
identical leading slots. Requests stop after 8, 16 or 24 tokens, so the decode batch
shrinks 26 -> 17 -> 9 and, with graphs on, is replayed from different captured sizes (32,
24, 12 with SGLang's default sizes), each with padding rows.

Every engine runs in its own subprocess (its GPU memory is only reliably freed when its
process group ends), under a share of ``--budget`` seconds, with SGLang's info log in
``--out``. From that log the check reads SGLang's own per-step report ("Decode batch ...
cuda graph: True/False"): with graphs on, prefixattn passes only if its decode steps ran as
CUDA graphs; with graphs off, only if none did.

Pass criteria (the rule of ``tools/vllm/check_engine.py``), per request: the greedy
tokens agree up to the first position where the reference's top-2 logprobs are within
``2 * TOL`` (a near tie that bf16 rounding may legally flip; after a flip the continuations
differ), and the chosen tokens' logprobs agree within ``TOL`` up to there. ``TOL = 0.05``:
both backends compute in bf16 with fp32 accumulation and round the attention output to bf16
(relative 2^-8) in different orders; after four layers and the LM head that stays well below
0.05 nats, while a wrong mask, scale, page or padding row stays far above it.

With ``--decode-only`` the checked engine runs the reference backend for prefill and
prefixattn for decode (``--attention-backend triton --decode-attention-backend prefixattn``:
SGLang's hybrid backend), against the reference alone.

    python -m tools.sglang.engine_check --out DIR [--graph-modes on off] [--budget S]
        [--decode-only]
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
from pathlib import Path
from typing import Any

from tools import RESULTS
from tools.proc_group import run_in_group
from tools.prompt_trees import two_level_tree

TOL = 0.05
VOCAB = 8192


def save_model(path: str) -> None:
    """A 4-layer Llama (hidden 1024, 8/2 heads, head_dim 128) with random bf16 weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, head_dim=128, vocab_size=VOCAB, max_position_embeddings=8192,
        initializer_range=0.02, torch_dtype="bfloat16", tie_word_embeddings=False,
    )  # fmt: skip
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)


def prompts(seed: int = 0) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """(warm-up prompts that fill the radix cache, checked prompts, max_new_tokens of each)."""
    rng = random.Random(seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(10, VOCAB) for _ in range(n)]

    warm, checked = two_level_tree(rng, VOCAB)
    checked += [toks(33), toks(1)]  # nothing shared; a one-token prompt
    return warm, checked, [8 + 8 * (i % 3) for i in range(len(checked))]


DECODE_ONLY = "-prefill-prefixattn-decode"  # label suffix: REF for prefill, prefixattn for decode


def backend_args(backend: str) -> dict[str, str]:
    """SGLang's backend arguments for a label: ``NAME``, or ``REF-prefill-prefixattn-decode``."""
    if backend.endswith(DECODE_ONLY):
        prefill = backend.removesuffix(DECODE_ONLY)
        return {"attention_backend": prefill, "prefill_attention_backend": prefill,
                "decode_attention_backend": "prefixattn"}  # fmt: skip
    return {"attention_backend": backend}


def run_engine(model: str, backend: str, graphs: bool) -> dict:
    """One engine, in this process: greedy tokens and top-2 logprobs of every checked prompt."""
    import sglang as sgl

    warm, checked, max_new = prompts()
    t0 = time.time()
    llm = sgl.Engine(
        model_path=model, skip_tokenizer_init=True, **backend_args(backend),
        disable_cuda_graph=not graphs, cuda_graph_max_bs_decode=32, mem_fraction_static=0.5,
        context_length=4096, max_running_requests=64, random_seed=0, log_level="info",
        decode_log_interval=1,
    )  # fmt: skip
    start_s = time.time() - t0
    try:
        sp = {"temperature": 0, "ignore_eos": True}
        llm.generate(input_ids=warm, sampling_params={**sp, "max_new_tokens": 1})
        outs = llm.generate(
            input_ids=checked,
            sampling_params=[{**sp, "max_new_tokens": n} for n in max_new],
            return_logprob=True,
            top_logprobs_num=2,
        )
        info = llm.get_server_info()
    finally:
        llm.shutdown()
    res = []
    for o in outs:
        meta = o["meta_info"]
        res.append(
            {
                "tokens": list(o["output_ids"]),
                "logprobs": [x[0] for x in meta["output_token_logprobs"]],
                "top2": [[t[0] for t in x[:2]] for x in meta["output_top_logprobs"]],
                "cached_tokens": meta.get("cached_tokens"),
            }
        )
    keys = ("attention_backend", "prefill_attention_backend", "decode_attention_backend",
            "cuda_graph_config", "max_total_num_tokens", "version")  # fmt: skip
    return {
        "backend": backend,
        "graphs": graphs,
        "start_s": round(start_s, 1),
        "server": {k: info.get(k) for k in keys},
        "outputs": res,
    }


def compare(ref: list[dict], got: list[dict]) -> dict:
    """The vLLM check's rule: tokens agree up to the first near tie of the reference (top-2
    gap < 2 * TOL), chosen-token logprobs within TOL up to there."""
    worst, compared, flips = 0.0, 0, 0
    for a, b in zip(ref, got, strict=True):
        for i, (ta, tb) in enumerate(zip(a["tokens"], b["tokens"], strict=True)):
            top = a["top2"][i]
            near_tie = len(top) > 1 and top[0] - top[1] < 2 * TOL
            if ta != tb:
                if not near_tie:
                    return {"ok": False, "why": f"token mismatch at {i} without a near tie"}
                flips += 1
                break
            worst = max(worst, abs(a["logprobs"][i] - b["logprobs"][i]))
            compared += 1
            if near_tie:
                break
    return {"ok": worst <= TOL, "max_logprob_diff": worst, "tokens": compared, "flips": flips}


DECODE_LINE = re.compile(r"Decode batch.*?#running-req: (\d+).*?cuda graph: (True|False)")


def decode_steps(log: Path) -> dict:
    """SGLang's per-step decode reports in an engine's log: how many ran as CUDA graphs."""
    steps = [(int(n), g == "True") for n, g in DECODE_LINE.findall(log.read_text(errors="replace"))]
    return {
        "reported": len(steps),
        "graph": sum(g for _, g in steps),
        "batch_sizes": sorted({n for n, _ in steps}, reverse=True),
    }


def run_one(model: str, backend: str, mode: str, out: Path, timeout: float) -> dict:
    """``run_engine`` in a subprocess (own process group, killed on timeout)."""
    result = out / f"sglang_check_{backend}_{mode}.json"
    log = out / f"sglang_check_{backend}_{mode}.log"
    result.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "tools.sglang.engine_check",
        "--one",
        backend,
        mode,
        "--model",
        model,
        "--out",
        str(out),
    ]
    t0 = time.monotonic()
    code = run_in_group(cmd, timeout, log)
    wall = round(time.monotonic() - t0, 1)
    print(f"{backend} graphs={mode}: exit {code} after {wall} s (log {log})", flush=True)
    if code != 0 or not result.exists():
        tail = log.read_text(errors="replace").strip().splitlines()[-15:]
        return {"error": f"engine run exited {code} after {wall} s", "log_tail": tail}
    data = json.loads(result.read_text())
    data["wall_s"] = wall
    data["decode_steps"] = decode_steps(log)
    return data


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=RESULTS / "sglang-check",
                    help=f"folder for results and logs (default {RESULTS}/sglang-check)")  # fmt: skip
    ap.add_argument("--reference", default="triton", help="SGLang backend: triton or flashinfer")
    ap.add_argument("--graph-modes", nargs="+", choices=["on", "off"], default=["on", "off"])
    ap.add_argument("--budget", type=float, default=420.0, help="seconds for all engine runs")
    ap.add_argument("--model", help="an existing model folder (default: write a fresh one)")
    ap.add_argument("--decode-only", action="store_true",
                    help="check prefixattn as the decode backend beside the reference's prefill")  # fmt: skip
    ap.add_argument("--one", nargs=2, metavar=("BACKEND", "MODE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    # On SIGTERM (e.g. from `timeout`) unwind, so the engines' process groups get killed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.out.mkdir(parents=True, exist_ok=True)
    if args.one:
        backend, mode = args.one
        data = run_engine(args.model, backend, mode == "on")
        (args.out / f"sglang_check_{backend}_{mode}.json").write_text(json.dumps(data))
        return 0

    deadline = time.monotonic() + args.budget
    model = args.model or os.path.join(tempfile.mkdtemp(), "tiny-llama")
    if not args.model:
        save_model(model)
    candidate = args.reference + DECODE_ONLY if args.decode_only else "prefixattn"
    backends = (args.reference, candidate)
    summary: dict[str, Any] = {}
    runs_left = len(backends) * len(args.graph_modes)
    for mode in args.graph_modes:
        res = {}
        for backend in backends:
            runs_left -= 1
            timeout = deadline - time.monotonic() - 45 * runs_left  # leave later runs 45 s
            res[backend] = run_one(model, backend, mode, args.out, timeout)
        ref, got = res[args.reference], res[candidate]
        if "error" in ref or "error" in got:
            result: dict[str, Any] = {
                "ok": False,
                "why": f"{args.reference}: {ref.get('error', 'ok')}; "
                f"prefixattn: {got.get('error', 'ok')}",
            }
        else:
            result = compare(ref["outputs"], got["outputs"])
            steps = got["decode_steps"]
            want_graphs = mode == "on"
            graphs_ok = steps["reported"] > 0 and (
                steps["graph"] == steps["reported"] if want_graphs else steps["graph"] == 0
            )
            result["prefixattn_decode_steps"] = steps
            result["reference_decode_steps"] = ref["decode_steps"]
            if not graphs_ok:
                result["ok"] = False
                result.setdefault(
                    "why", f"prefixattn decode steps as CUDA graphs: {steps} (graphs {mode})"
                )
            result["cached_tokens"] = [o["cached_tokens"] for o in got["outputs"]]
            result["start_s"] = {b: r["start_s"] for b, r in res.items()}
            result["server"] = got["server"]
        result["errors"] = {b: r for b, r in res.items() if "error" in r}
        summary[("decode_only_" if args.decode_only else "") + f"graphs_{mode}"] = result
        print(f"graphs {mode}:", json.dumps(result), flush=True)
        (args.out / "sglang_engine_check.json").write_text(json.dumps(summary, indent=1))
    ok = bool(summary) and all(v["ok"] for v in summary.values())
    print("engine_check", "PASS" if ok else "FAIL", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
