"""End-to-end decode step time in SGLang: prefixattn against flashinfer and triton, one run.

An 8B-Llama-shaped model (32 layers, hidden 4096, 32/8 heads, head_dim 128) with dummy
weights (only config.json is written). Workloads, each B requests:
- ``shared1``: one P-token prefix shared by all, private tails of 64 tokens;
- ``shared3``: a 3-level tree (P/2 root, 4 children of P/4, 16 of P/4), tails of 64;
- ``none``: P+64 private tokens each.
Decode step time = (T(1 + n) - T(1)) / n from two greedy generations over prompts already
in the radix cache (so both prefill only one token per request), with ignore_eos.

    python integration/sglang/bench_decode.py --batch 256 --prefix 4096 --out decode.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "rms_norm_eps": 1e-5,
    "max_position_embeddings": 16384, "rope_theta": 500000.0, "torch_dtype": "bfloat16",
    "tie_word_embeddings": False, "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip


def workload(kind: str, batch: int, prefix: int, tail: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(10, 120000) for _ in range(n)]

    if kind == "shared1":
        root = toks(prefix)
        return [root + toks(tail) for _ in range(batch)]
    if kind == "shared3":
        root = toks(prefix // 2)
        mids = [toks(prefix // 4) for _ in range(4)]
        lows = [toks(prefix // 4) for _ in range(16)]
        return [root + mids[(i % 16) // 4] + lows[i % 16] + toks(tail) for i in range(batch)]
    return [toks(prefix + tail) for _ in range(batch)]


def bench(model: str, backend: str, loads: dict, steps: int, graphs: bool) -> dict:
    import sglang as sgl

    llm = sgl.Engine(
        model_path=model, load_format="dummy", skip_tokenizer_init=True,
        attention_backend=backend, disable_cuda_graph=not graphs,
        mem_fraction_static=0.8, max_running_requests=256, chunked_prefill_size=16384,
        cuda_graph_max_bs=256, log_level="warning",
    )  # fmt: skip
    out = {}
    try:
        for name, prompts in loads.items():
            sp = {"temperature": 0, "ignore_eos": True}
            llm.generate(input_ids=prompts, sampling_params={**sp, "max_new_tokens": 1})
            times = {}
            for n in (1, 1 + steps):
                t0 = time.perf_counter()
                llm.generate(input_ids=prompts, sampling_params={**sp, "max_new_tokens": n})
                times[n] = time.perf_counter() - t0
            step_ms = (times[1 + steps] - times[1]) / steps * 1e3
            out[name] = round(step_ms, 3)
            print(f"{backend} graphs={graphs} {name}: decode step {step_ms:.2f} ms", flush=True)
            llm.flush_cache()
    finally:
        llm.shutdown()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--prefix", type=int, default=4096)
    ap.add_argument("--tail", type=int, default=64)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--backends", nargs="+", default=["prefixattn", "flashinfer", "triton"])
    ap.add_argument("--workloads", nargs="+", default=["shared1", "shared3", "none"])
    ap.add_argument("--graphs", action="store_true")
    ap.add_argument("--out", default="bench_decode.json")
    args = ap.parse_args()
    model = os.path.join(tempfile.mkdtemp(), "llama8b-shape")
    os.makedirs(model)
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump(LLAMA_8B, f)
    loads = {w: workload(w, args.batch, args.prefix, args.tail) for w in args.workloads}
    results = {"batch": args.batch, "prefix": args.prefix, "tail": args.tail,
               "graphs": args.graphs, "step_ms": {}}  # fmt: skip
    for backend in args.backends:
        try:
            results["step_ms"][backend] = bench(model, backend, loads, args.steps, args.graphs)
        except Exception as e:
            results["step_ms"][backend] = {"error": f"{type(e).__name__}: {e}"}
            print(f"{backend}: {e}", flush=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    print(json.dumps(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
