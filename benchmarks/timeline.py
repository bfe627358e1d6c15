"""Per-kernel timeline of prefixattn's calls on PAT trees: when each launch of a call starts
and ends, relative to the call's first kernel (torch profiler, L2 flushed and a GPU spin
before each call, as in the benchmark's timer). Shows how the launches of a call overlap
(chained launches) and which one ends last.

    python benchmarks/timeline.py --trees 1,256_256,32 1,2,64_1024,256,256 --heads 32/8
"""

import argparse
import math

import torch

import prefixattn
from prefixattn.bench import _short_kernel_name, _Timer, profile_kernel_events, split_calls
from prefixattn.runtime.buffers import Workspace
from prefixattn.runtime.launch import run_plan
from prefixattn.workloads import parse_heads, tree_batch


def timeline(timer: _Timer, spec: str, hq: int, hkv: int, ps: int, d: int, calls: int) -> None:
    table, lens = tree_batch(spec, ps, seed=0)
    num_pages = int(table.max()) + 1
    k = torch.randn(num_pages, ps, hkv, d, device="cuda").to(torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(len(lens), hq, d, device="cuda").to(torch.bfloat16)
    out = torch.empty_like(q)
    pa = prefixattn.PrefixAttention(hq, hkv, d, ps, device="cuda", dtype=torch.bfloat16)
    plan = pa.plan(table, lens)
    ws = Workspace("cuda")

    def call() -> None:
        run_plan(plan, q, k, v, out, 1 / math.sqrt(d), ws, pa.launch_options,
                 finish=pa.finish_in_leaf)  # fmt: skip

    us = timer.median_us(call)
    events = profile_kernel_events(torch, call, timer.flush, calls, timer.SPIN_CYCLES)
    groups = split_calls(events)
    print(f"== {spec} {hq},{hkv} page {ps}: {us:.1f} us (timed); {plan.summary()}")
    for group in groups[1:]:  # the first call may include the profiler's start-up
        t0 = float(group[0]["ts"])
        for e in group:
            name = _short_kernel_name(e["name"])
            start, dur = float(e["ts"]) - t0, float(e["dur"])
            grid = e.get("args", {}).get("grid")
            print(f"   +{start:6.1f} us, {dur:6.1f} us long, ends {start + dur:6.1f}  "
                  f"grid {grid}  {name}")  # fmt: skip
        print("   --")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trees", nargs="+", default=["1,256_256,32"])
    ap.add_argument("--heads", nargs="+", default=["32/8"], help="QO/KV head pairs, e.g. 32/8")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--calls", type=int, default=4)
    args = ap.parse_args()
    timer = _Timer(torch, 15)
    for spec in args.trees:
        for heads in args.heads:
            hq, hkv = parse_heads(heads)
            timeline(timer, spec, hq, hkv, args.page_size, args.head_dim, args.calls)


if __name__ == "__main__":
    main()
