"""GPU check: ``sglang.Engine(attention_backend="prefixattn")`` against SGLang's own backend.

A small Llama with random weights (normal, std 0.02, so logits are not flat and attention
errors show) is saved with ``transformers``; prompts share multi-level prefixes. The radix
cache is filled with the shared prefixes first, so the checked batch decodes over rows with
identical leading slots. Each configuration runs in its own Engine:

    python integration/sglang/engine_check.py --out results.json [--graph-modes off on]

Pass criteria (bf16 model; both backends accumulate in fp32 but round the attention output
to bf16 in a different order, about 2^-8 relative):
- greedy tokens equal wherever the reference's top-2 logprob gap exceeds ``--tie``;
- per-token logprob differences at most ``--atol`` nats until the first (near-tie) divergence.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time


def save_model(path: str, *, layers: int = 2, hidden: int = 1024, heads: int = 8,
               kv_heads: int = 2, vocab: int = 4096, seed: int = 0) -> None:  # fmt: skip
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=4096,
        initializer_range=0.02,
        torch_dtype="bfloat16",
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path)


def prompts(vocab: int, seed: int = 1) -> tuple[list[list[int]], list[list[int]]]:
    """(warm-up prompts that put the shared prefixes in the radix cache, checked prompts)."""
    rng = random.Random(seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(n)]

    root = toks(517)  # level 1, shared by 8 requests
    mids = [toks(129), toks(33)]  # level 2, 4 requests each
    checked = [root + mids[i // 4] + toks(rng.randrange(1, 40)) for i in range(8)]
    checked += [toks(211), toks(1)]  # nothing shared; a one-token prompt
    warm = [root + m for m in mids]
    return warm, checked


def run_engine(model: str, backend: str, graphs: bool, warm, checked, max_new: int) -> dict:
    import sglang as sgl

    t0 = time.time()
    llm = sgl.Engine(
        model_path=model,
        skip_tokenizer_init=True,
        attention_backend=backend,
        disable_cuda_graph=not graphs,
        mem_fraction_static=0.3,
        max_running_requests=64,
        log_level="warning",
    )
    start_s = time.time() - t0
    params = {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}
    llm.generate(input_ids=warm, sampling_params={**params, "max_new_tokens": 1})
    outs = llm.generate(
        input_ids=checked, sampling_params=params, return_logprob=True, top_logprobs_num=2
    )
    llm.shutdown()
    res = []
    for o in outs:
        meta = o["meta_info"]
        res.append(
            {
                "ids": o["output_ids"],
                "logprobs": [x[0] for x in meta["output_token_logprobs"]],
                "top2": [[t[0] for t in x[:2]] for x in meta["output_top_logprobs"]],
                "cached_tokens": meta.get("cached_tokens"),
            }
        )
    return {"backend": backend, "graphs": graphs, "start_s": round(start_s, 1), "outputs": res}


def compare(ref: dict, got: dict, tie: float, atol: float) -> dict:
    max_diff, mismatches, tie_breaks = 0.0, 0, 0
    for r, g in zip(ref["outputs"], got["outputs"], strict=True):
        for i, (a, b) in enumerate(zip(r["ids"], g["ids"], strict=False)):
            max_diff = max(max_diff, abs(r["logprobs"][i] - g["logprobs"][i]))
            if a != b:
                top = r["top2"][i]
                if len(top) == 2 and top[0] - top[1] <= tie:
                    tie_breaks += 1
                else:
                    mismatches += 1
                break  # after a divergence the two continuations differ
    ok = mismatches == 0 and max_diff <= atol
    return {"max_logprob_diff": max_diff, "token_mismatches": mismatches,
            "near_tie_divergences": tie_breaks, "ok": ok}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="engine_check.json")
    ap.add_argument("--reference", default="triton")
    ap.add_argument(
        "--graph-modes",
        nargs="+",
        choices=["off", "on"],
        default=["off", "on"],
        help="CUDA graphs off and/or on (each a pair of Engines)",
    )
    ap.add_argument("--max-new", type=int, default=24)
    ap.add_argument("--tie", type=float, default=0.05)
    ap.add_argument("--atol", type=float, default=0.05)
    args = ap.parse_args()
    model = os.path.join(tempfile.mkdtemp(), "tiny-llama")
    save_model(model)
    warm, checked = prompts(4096)
    runs = []
    for graphs in [m == "on" for m in args.graph_modes]:
        ref = run_engine(model, args.reference, graphs, warm, checked, args.max_new)
        try:
            got = run_engine(model, "prefixattn", graphs, warm, checked, args.max_new)
        except Exception as e:  # reported, not hidden: e.g. graphs without CUDA kernels
            runs.append({"graphs": graphs, "error": f"{type(e).__name__}: {e}"})
            print(f"graphs={graphs}: prefixattn failed: {e}", flush=True)
            continue
        cmp = compare(ref, got, args.tie, args.atol)
        cmp.update(graphs=graphs, ref_start_s=ref["start_s"], start_s=got["start_s"],
                   cached_tokens=[o["cached_tokens"] for o in got["outputs"]])  # fmt: skip
        runs.append(cmp)
        print(json.dumps(cmp), flush=True)
        print("ref ids[0]", ref["outputs"][0]["ids"][:12], flush=True)
        print("got ids[0]", got["outputs"][0]["ids"][:12], flush=True)
    with open(args.out, "w") as f:
        json.dump(runs, f, indent=1)
    return 0 if runs and all(r.get("ok") for r in runs if "error" not in r) else 1


if __name__ == "__main__":
    sys.exit(main())
