"""Predict the split rule's effect from a benchmark run that measured both extremes.

For each configuration of a `bench_attention.py --ablations` result whose kernels split every
long item (`prefixattn_us` of a run before `split_target`, or `split_all_us`) and measured
`no_split_us`, plan the batch with `split_target` and classify the plan: identical to the
split-everything plan, identical to the unsplit plan, or in between (kept at the split-
everything time). Prints each configuration that changes and the predicted geomean.

    python benchmarks/split_rule_prediction.py docs/results/bench_attention_latest.json
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

from prefixattn import PrefixAttention, tree_batch


def _key(plan) -> tuple[int, ...]:  # type: ignore[no-untyped-def]
    return (plan.num_work_items, plan.num_ctas, plan.kv_bytes, plan.num_partials)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("result", help="bench_attention JSON with no_split_us")
    ap.add_argument("--split-target", type=int, default=132)
    ap.add_argument("--head-dim", type=int, default=128)
    args = ap.parse_args()
    rows = json.loads(Path(args.result).read_text())["rows"]
    old, new, changed = [], [], 0
    for r in rows:
        split_us = r.get("split_all_us", r["prefixattn_us"])
        (hq, hkv), ps = r["heads"], r["page_size"]
        table, lens = tree_batch(r["tree"], ps)
        pa = PrefixAttention(hq, hkv, args.head_dim, ps)
        pa.split_target = 0
        every = _key(pa.plan(table, lens))
        whole = _key(pa.plan(table, lens, split_kv=False))
        pa.split_target = args.split_target
        got = _key(pa.plan(table, lens))
        tag = "split" if got == every else "unsplit" if got == whole else "between"
        t = r["no_split_us"] if tag == "unsplit" else split_us
        old.append(r["floor_us"] / split_us)
        new.append(r["floor_us"] / t)
        if tag != "split":
            changed += 1
            print(f"{r['tree']:45s} {hq}/{hkv} p{ps}: {tag:8s} split {split_us:8.1f} us, "
                  f"unsplit {r['no_split_us']:8.1f} us")  # fmt: skip

    def geo(x: list[float]) -> float:
        return 100 * math.exp(float(np.mean(np.log(x))))

    print(f"{changed} of {len(rows)} configurations change; geomean % of floor "
          f"{geo(old):.1f} (split everything) -> {geo(new):.1f} predicted")  # fmt: skip


if __name__ == "__main__":
    main()
