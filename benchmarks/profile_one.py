"""Run one PAT tree through the CUDA kernels a few times, for a profiler to watch.

    ncu --clock-control none --section SpeedOfLight --section WarpStateStats \\
        python benchmarks/profile_one.py --tree 1,1024_2048,32 --heads 32,8

--flashinfer runs FlashInfer's batch decode on the same inputs instead (the bench's wrapper).
"""

import argparse
import functools
import math

import torch

import prefixattn
from prefixattn import LaunchOptions
from prefixattn.runtime.buffers import Workspace
from prefixattn.runtime.launch import run_plan
from prefixattn.workloads import parse_heads, tree_batch

ap = argparse.ArgumentParser()
ap.add_argument("--tree", default="1,1024_2048,32")
ap.add_argument("--heads", default="32/8", help="QO/KV heads, e.g. 32/8")
ap.add_argument("--page-size", type=int, default=16)
ap.add_argument("--head-dim", type=int, default=128)
ap.add_argument("--packing", default="memory")
ap.add_argument("--no-split", action="store_true")
ap.add_argument("--iters", type=int, default=3)
ap.add_argument("--flashinfer", action="store_true")
args = ap.parse_args()
hq, hkv = parse_heads(args.heads)
d, ps = args.head_dim, args.page_size
table, lens = tree_batch(args.tree, ps, seed=0)
num_pages = int(table.max()) + 1
k = torch.randn(num_pages, ps, hkv, d, device="cuda", dtype=torch.bfloat16)
v = torch.randn_like(k)
q = torch.randn(len(lens), hq, d, device="cuda", dtype=torch.bfloat16)
out = torch.empty_like(q)
pa = prefixattn.PrefixAttention(hq, hkv, d, ps, device="cuda", dtype=torch.bfloat16)
plan = pa.plan(table, lens, packing=args.packing, split_kv=not args.no_split)
print(plan.summary())
ws = Workspace("cuda")
if args.flashinfer:
    import flashinfer

    from prefixattn.bench import _flashinfer_decode

    call = _flashinfer_decode(torch, flashinfer, table, lens, ps, hq, hkv, d, q, k, v)
else:
    options = LaunchOptions(chain_launches=False)
    call = functools.partial(run_plan, plan, q, k, v, out, 1 / math.sqrt(d), ws, options)
for _ in range(args.iters):
    call()
torch.cuda.synchronize()
