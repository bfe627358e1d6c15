"""Host plan construction: Python ``build_forest`` + ``pack`` against the native builder.

    python benchmarks/bench_plan.py [--tree 1,16,256_2048,1024,1024] [--page-sizes 16,1]
                                    [--repeat 300] [--packing memory]

Prints, per page size, the median (and min / p90) over ``--repeat`` calls of:

- ``python``: ``build_forest`` + ``pack`` (prefixattn/forest.py, prefixattn/packer.py);
- ``native``: ``build_plan_native`` (the same arrays from the compiled ``build_plan`` op,
  numpy in and out);
- ``native op``: the op call alone (torch tensors in and out, no Python objects built);
- ``plan() python`` / ``plan() native``: a whole ``PrefixAttention.plan`` call (argument
  checks, plan object, CPU tensors) with ``native_plan`` off / on. The native plan is checked
  to equal the Python one.

Run on an otherwise idle core for stable numbers; the medians are what to compare.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import torch

from prefixattn import PrefixAttention, build_forest, tree_batch
from prefixattn.attention import DEFAULT_SPLIT_TARGET
from prefixattn.plan.native import build_plan_native
from prefixattn.plan.packing import PACKINGS, pack
from prefixattn.runtime.library import native_plan_available
from prefixattn.workloads import parse_heads


def _times(fn: Callable[[], object], repeat: int) -> np.ndarray:
    for _ in range(min(20, repeat)):
        fn()
    out = np.empty(repeat)
    for i in range(repeat):
        t0 = time.perf_counter()
        fn()
        out[i] = time.perf_counter() - t0
    return out * 1e6


def _bench_page_size(args: argparse.Namespace, hq: int, hkv: int, ps: int) -> None:
    op = torch.ops.prefixattn.build_plan
    bt, sl = tree_batch(args.tree, ps)
    lens = sl.astype(np.int64)
    indptr = np.arange(len(sl) + 1, dtype=np.int64)
    pa = PrefixAttention(hq, hkv, 128, ps, dtype=torch.bfloat16)
    shape, table = pa._shape, pa.tiles
    target = DEFAULT_SPLIT_TARGET  # what plan() uses for a CPU device

    def python() -> object:
        f = build_forest(bt, lens, ps)
        return pack(f, bt, lens, indptr, shape, table, args.packing, True, target)

    def native() -> object:
        return build_plan_native(bt, lens, indptr, ps, shape, table, args.packing, True, target)

    tensors = (torch.from_numpy(bt), torch.from_numpy(lens), torch.from_numpy(indptr))
    n_by = table.n_by_kv_len
    op_args = (*tensors, ps, hq, hkv, 128, shape.elem_bytes, list(table.m_sizes),
               [b for b, _ in n_by], [n for _, n in n_by], args.packing, True, target, True)  # fmt: skip

    def native_op() -> object:
        return op(*op_args)

    def plan_call() -> object:
        return pa.plan(bt, sl, packing=args.packing)

    pa.native_plan = False
    reference = pa.plan(bt, sl, packing=args.packing)
    t_plan_python = _times(plan_call, args.repeat)
    pa.native_plan = True
    native_plan = pa.plan(bt, sl, packing=args.packing)
    for name in reference.host.__dataclass_fields__:
        np.testing.assert_array_equal(
            getattr(native_plan.host, name), getattr(reference.host, name)
        )
    assert native_plan.tiles == reference.tiles
    assert native_plan.kv_bytes == reference.kv_bytes
    t_plan_native = _times(plan_call, args.repeat)

    rows = [
        ("python", _times(python, args.repeat)),
        ("native", _times(native, args.repeat)),
        ("native op", _times(native_op, args.repeat)),
        ("plan() python", t_plan_python),
        ("plan() native", t_plan_native),
    ]
    print(f"page_size {ps}: block table {bt.shape[0]}x{bt.shape[1]}, "
          f"{reference.num_work_items} items")  # fmt: skip
    for name, t in rows:
        print(f"  {name:<14} {np.median(t):9.1f}  ({t.min():.1f}, {np.percentile(t, 90):.1f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tree", default="1,16,256_2048,1024,1024")
    parser.add_argument("--page-sizes", default="16,1")
    parser.add_argument("--repeat", type=int, default=300)
    parser.add_argument("--packing", default="memory", choices=PACKINGS)
    parser.add_argument("--heads", default="32/8", help="QO/KV heads, e.g. 32/8")
    args = parser.parse_args()
    if not native_plan_available():
        raise SystemExit("the compiled prefixattn library (build_plan op) is not available")
    hq, hkv = parse_heads(args.heads)
    print(f"tree {args.tree}, heads {hq}/{hkv}, head_dim 128, packing {args.packing}, "
          f"split on; microseconds, median (min, p90) of {args.repeat}")  # fmt: skip
    for ps in (int(x) for x in args.page_sizes.split(",")):
        _bench_page_size(args, hq, hkv, ps)


if __name__ == "__main__":
    main()
