"""The time to read a decode step's distinct KV once, on this GPU, with nothing else running.

A backend that attends must read every KV byte the step's queries see at least once. This
measures that read alone: one ``sum`` per layer over a buffer of the layer's distinct KV
(K and V of ``--tokens`` positions, ``--kv-heads`` x ``--head-dim``, bf16), every layer's
buffer apart so that no read hits L2. Added to the attention-free bound's step time (measured
by the decode benchmarks), it is the shortest step any attention backend can take, so
``bound / (bound + read)`` is the highest percent of the bound it can reach.

    python -m tools.kv_read_floor --tokens 34816 --layers 32 [--kv-heads 8 --head-dim 128]

Worked example: 256 requests sharing a 4096-token prefix with 64-token private tails, 56
tokens generated each on average (the middle of a timed window from token 8 to 104):
4096 + 256 * (64 + 56) = 34816 distinct tokens per layer, 4 KiB each at 8 KV heads x 128:
143 MB per layer, 4.6 GB per step.
"""

from __future__ import annotations

import argparse
import json
import statistics


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, required=True, help="distinct KV tokens per layer")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    per_layer = (args.tokens, 2, args.kv_heads, args.head_dim)
    layers = [
        torch.ones(per_layer, dtype=torch.bfloat16, device="cuda") for _ in range(args.layers)
    ]
    nbytes = sum(x.numel() * x.element_size() for x in layers)
    sink = torch.zeros(args.layers, dtype=torch.float32, device="cuda")

    def step() -> None:
        for i, x in enumerate(layers):
            sink[i] += x.sum(dtype=torch.float32)

    for _ in range(3):
        step()
    times = []
    for _ in range(args.reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    ms = statistics.median(times)
    print(json.dumps({
        "gpu": torch.cuda.get_device_name(), "tokens_per_layer": args.tokens,
        "layers": args.layers, "bytes": nbytes, "read_ms": round(ms, 3),
        "read_tb_per_s": round(nbytes / (ms * 1e-3) / 1e12, 2),
    }))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
