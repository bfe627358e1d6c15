"""Predict a split rule's effect from a benchmark run that measured the split variants.

Input: a `bench_attention.py --ablations` result with `prefixattn_us` (the rule of that run,
whose plan summary is the row's `tiles`), `no_split_us` (`split_kv=False`) and
`split_all_us` (`split_target=0`). For each configuration, plan the batch with the planner
installed here (`--split-target`, the SM count) and compare its plan summary (items, CTAs,
tile groups, KV and partial bytes) with the three measured plans: where it equals one of
them, take that column's time; otherwise the plan is new ("between") and keeps the measured
default time. Prints each configuration whose time or plan changes and the predicted geomean
% of the floor.

Identical plans do not time identically in different columns of one run (docs/dev/log.md,
v8, "same-plan spread"). The script also prints each column's geometric-mean ratio to
`prefixattn_us` over the configurations where all three plans are identical, and the
prediction with the borrowed times divided by that ratio.

    python benchmarks/split_rule_prediction.py RUN.json
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

from prefixattn import PrefixAttention, tree_batch


def _geo(x: list[float]) -> float:
    return math.exp(float(np.mean(np.log(x))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("result", help="bench_attention JSON with no_split_us and split_all_us")
    ap.add_argument("--split-target", type=int, default=132)
    ap.add_argument("--head-dim", type=int, default=128)
    args = ap.parse_args()
    rows = json.loads(Path(args.result).read_text())["rows"]
    cols = {"default": "prefixattn_us", "no_split": "no_split_us", "split_all": "split_all_us"}
    picked: list[tuple[dict, str]] = []
    same_plan_rows = []
    for r in rows:
        (hq, hkv), ps = r["heads"], r["page_size"]
        table, lens = tree_batch(r["tree"], ps)
        pa = PrefixAttention(hq, hkv, args.head_dim, ps)
        pa.split_target = 0
        plans = {"default": r["tiles"], "split_all": pa.plan(table, lens).summary()}
        plans["no_split"] = pa.plan(table, lens, split_kv=False).summary()
        pa.split_target = args.split_target
        got = pa.plan(table, lens).summary()
        if len(set(plans.values())) == 1:
            same_plan_rows.append(r)
        tag = next((name for name, plan in plans.items() if plan == got), "between")
        picked.append((r, tag))

    # Column bias: each column's time over prefixattn_us where the three plans are identical.
    bias = {"default": 1.0, "between": 1.0}
    for name, col in cols.items():
        if name != "default":
            ratios = [r[col] / r["prefixattn_us"] for r in same_plan_rows]
            bias[name] = _geo(ratios) if ratios else 1.0

    old, new, adjusted, between = [], [], [], 0
    for r, tag in picked:
        t = r[cols.get(tag, "prefixattn_us")]
        old.append(r["floor_us"] / r["prefixattn_us"])
        new.append(r["floor_us"] / t)
        adjusted.append(r["floor_us"] / (t / bias[tag]))
        between += tag == "between"
        if tag != "default":
            (hq, hkv), ps = r["heads"], r["page_size"]
            print(f"{r['tree']:45s} {hq}/{hkv} p{ps}: {tag:9s} {r['prefixattn_us']:8.1f} -> "
                  f"{t:8.1f} us (no_split {r['no_split_us']:8.1f}, "
                  f"split_all {r['split_all_us']:8.1f})")  # fmt: skip
    changed = sum(tag != "default" for _, tag in picked)
    print(f"column time / prefixattn_us on {len(same_plan_rows)} configurations with one plan: "
          + ", ".join(f"{n} {bias[n]:.3f}" for n in ("no_split", "split_all")))  # fmt: skip
    print(f"{changed} of {len(rows)} configurations change plan ({between} to a plan not "
          f"measured, kept at the measured time); geomean % of floor "
          f"{100 * _geo(old):.2f} -> {100 * _geo(new):.2f} predicted, "
          f"{100 * _geo(adjusted):.2f} with the column ratios removed")  # fmt: skip


if __name__ == "__main__":
    main()
