"""How much of the HBM floor each plan of the benchmark suite can reach, on the host (no GPU).

The benchmark's floor counts the distinct KV entries, q and the output. A plan also writes
partial rows and reads them back in the merge, and may read a shared page more than once
(row chunks of one node, split parts). This prints, per configuration of the suite, the
plan's bytes (``prefixattn.bench.plan_traffic``) and the share of the floor the plan reaches
at the full bandwidth with repeated page reads served from L2 (``cap``) and from HBM
(``cap_reads``), then their geometric means. A measured ``bench_attention.py`` JSON
(``--result``) adds the measured share of the floor and the share of the plan's own bound.

    python benchmarks/plan_traffic.py --result RUN.json
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from prefixattn import PrefixAttention, tree_batch
from prefixattn.bench import HEADS, PAGE1_TREES, PAT_TREES, plan_traffic, suite_configs
from prefixattn.workloads import parse_heads


def _geo(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def rows(
    trees: list[str], heads: list[tuple[int, int]], page_size: int, page1: list[str], d: int
) -> list[dict]:
    out = []
    for spec, (hq, hkv), ps in suite_configs(trees, heads, page_size, page1):
        table, lens = tree_batch(spec, ps, seed=0)
        pa = PrefixAttention(hq, hkv, d, ps, device="cpu", dtype=torch.bfloat16)
        tr = plan_traffic(pa.plan(table, lens))
        out.append({"tree": spec, "heads": [hq, hkv], "page_size": ps, **tr,
                    "cap": tr["floor"] / tr["plan"], "cap_reads": tr["floor"] / tr["plan_reads"]})  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--result", type=Path, help="a bench_attention.py JSON to compare with")
    ap.add_argument("--trees", nargs="*", default=list(PAT_TREES))
    ap.add_argument("--heads", nargs="*", default=[f"{a}/{b}" for a, b in HEADS],
                    help="QO/KV head pairs, e.g. 32/8")  # fmt: skip
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--page1-trees", nargs="*", default=list(PAGE1_TREES))
    ap.add_argument("--head-dim", type=int, default=128)
    args = ap.parse_args(argv)
    heads = [parse_heads(h) for h in args.heads]
    table = rows(args.trees, heads, args.page_size, args.page1_trees, args.head_dim)
    measured: dict[tuple, float] = {}
    if args.result is not None:
        for r in json.loads(args.result.read_text())["rows"]:
            measured[(r["tree"], tuple(r["heads"]), r["page_size"])] = r["pct_floor"] / 100
    print(f"{'tree':46s} {'heads':>5s} pg {'floor MB':>9s} {'plan MB':>8s} {'reads MB':>9s}"
          f" {'cap':>5s} {'cap_rd':>6s}" + (f" {'meas':>5s} {'of cap':>6s}" if measured else ""))  # fmt: skip
    got = []
    for r in table:
        key = (r["tree"], tuple(r["heads"]), r["page_size"])
        line = (f"{r['tree']:46s} {r['heads'][0]:>2d},{r['heads'][1]:<2d} {r['page_size']:2d} "
                f"{r['floor'] / 1e6:9.1f} {r['plan'] / 1e6:8.1f} {r['plan_reads'] / 1e6:9.1f} "
                f"{100 * r['cap']:5.1f} {100 * r['cap_reads']:6.1f}")  # fmt: skip
        if key in measured:
            got.append((r, measured[key]))
            line += f" {100 * measured[key]:5.1f} {100 * measured[key] / r['cap']:6.1f}"
        print(line)
    print(f"geomean: cap {100 * _geo([r['cap'] for r in table]):.1f}%, "
          f"cap_reads {100 * _geo([r['cap_reads'] for r in table]):.1f}%")  # fmt: skip
    if got:
        print(f"measured ({len(got)} configurations): {100 * _geo([m for _, m in got]):.1f}% of "
              f"the floor, {100 * _geo([m / r['cap'] for r, m in got]):.1f}% of the plans' caps")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
