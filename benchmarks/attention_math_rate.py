"""Tensor-core rate of dense attention against a plain matmul on this GPU.

The benchmark's ceiling (prefixattn.bench, ``math_us``) counts a configuration's attention
FLOPs at the rate of a large bf16 matmul. This script measures how that rate compares with a
dense attention kernel's: FlashInfer's single prefill (FlashAttention-3 backend on Hopper,
non-causal, bf16, head_dim 128, GQA) on a long query block, next to an n x n x n matmul.

    python benchmarks/attention_math_rate.py [--qo-len 4096] [--kv-len 8192] [--heads 64/8]
"""

from __future__ import annotations

import argparse
import json
import sys

from prefixattn.workloads import parse_heads


def _time_ms(torch, fn, iters: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--qo-len", type=int, default=4096)
    ap.add_argument("--kv-len", type=int, default=8192)
    ap.add_argument("--heads", default="64/8", help="QO/KV heads, e.g. 64/8")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--matmul-n", type=int, default=8192)
    ap.add_argument("--backends", nargs="+", default=["fa3", "fa2"])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None, help="also write the results as JSON here")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("attention_math_rate: needs a CUDA GPU", file=sys.stderr)
        return 1
    hq, hkv = parse_heads(args.heads)
    d, n = args.head_dim, args.matmul_n
    res: dict = {"device": torch.cuda.get_device_name(), "qo_len": args.qo_len,
                 "kv_len": args.kv_len, "heads": [hq, hkv], "head_dim": d}  # fmt: skip
    a = torch.randn(n, n, device="cuda").to(torch.bfloat16)
    b = torch.randn(n, n, device="cuda").to(torch.bfloat16)
    ms = _time_ms(torch, lambda: a @ b, args.iters)
    res["matmul_tflops"] = 2 * n**3 / (ms * 1e-3) / 1e12
    print(f"bf16 matmul {n}^3: {ms:.3f} ms, {res['matmul_tflops']:.0f} TFLOP/s", flush=True)
    import flashinfer

    res["flashinfer"] = flashinfer.__version__
    q = torch.randn(args.qo_len, hq, d, device="cuda").to(torch.bfloat16)
    k = torch.randn(args.kv_len, hkv, d, device="cuda").to(torch.bfloat16)
    v = torch.randn(args.kv_len, hkv, d, device="cuda").to(torch.bfloat16)
    flops = 4 * args.qo_len * args.kv_len * d * hq
    for backend in args.backends:
        try:
            ms = _time_ms(
                torch,
                lambda backend=backend: flashinfer.single_prefill_with_kv_cache(
                    q, k, v, causal=False, backend=backend
                ),
                args.iters,
            )
        except Exception as e:  # a backend this build or GPU lacks
            res[f"prefill_{backend}_error"] = str(e)[:300]
            print(f"prefill {backend}: {str(e)[:300]}", flush=True)
            continue
        tflops = flops / (ms * 1e-3) / 1e12
        res[f"prefill_{backend}_tflops"] = tflops
        print(f"FlashInfer single prefill ({backend}), {args.qo_len} x {args.kv_len}, {hq}/{hkv} "
              f"heads: {ms:.3f} ms, {tflops:.0f} TFLOP/s, "
              f"{100 * tflops / res['matmul_tflops']:.0f}% of the matmul", flush=True)  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
