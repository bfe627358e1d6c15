"""Compare prefixattn's default plan between two builds timed in the same session.

    python benchmarks/compare_builds.py --base A1.json A2.json --new B1.json B2.json \
        [--out-md FILE]

Each JSON is a `prefixattn bench` report. Runs of one side are averaged per configuration;
FlashInfer's batch decode, timed in every run, shows how much the machine drifted between
the runs.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

Key = tuple[str, tuple[int, ...], int]


def _rows(paths: Sequence[str]) -> list[dict[Key, dict[str, Any]]]:
    runs = []
    for path in paths:
        rows = json.loads(Path(path).read_text())["rows"]
        runs.append({(r["tree"], tuple(r["heads"]), r["page_size"]): r for r in rows})
    return runs


def _mean(runs: list[dict[Key, dict[str, Any]]], key: Key, col: str) -> float | None:
    vals = [run[key][col] for run in runs if key in run and run[key].get(col)]
    return sum(vals) / len(vals) if vals else None


def _geomean(values: Sequence[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def compare(base: Sequence[str], new: Sequence[str]) -> dict[str, Any]:
    """Per configuration: floor, base and new prefixattn times (us), FlashInfer batch decode
    in each side's runs; plus geometric means of % of floor and of new/base."""
    b_runs, n_runs = _rows(base), _rows(new)
    keys = [k for k in b_runs[0] if all(k in r for r in b_runs + n_runs)]
    table = []
    for key in keys:
        floor = b_runs[0][key]["floor_us"]
        b, n = _mean(b_runs, key, "prefixattn_us"), _mean(n_runs, key, "prefixattn_us")
        if b is None or n is None:
            continue
        table.append({
            "tree": key[0], "heads": list(key[1]), "page_size": key[2], "floor_us": floor,
            "base_us": b, "new_us": n, "new_over_base": n / b,
            "fi_decode_base_us": _mean(b_runs, key, "fi_decode_us"),
            "fi_decode_new_us": _mean(n_runs, key, "fi_decode_us"),
        })  # fmt: skip
    drift = [r["fi_decode_new_us"] / r["fi_decode_base_us"] for r in table
             if r["fi_decode_base_us"] and r["fi_decode_new_us"]]  # fmt: skip
    return {
        "rows": table,
        "geomean_pct_floor_base": 100 * _geomean([r["floor_us"] / r["base_us"] for r in table]),
        "geomean_pct_floor_new": 100 * _geomean([r["floor_us"] / r["new_us"] for r in table]),
        "geomean_new_over_base": _geomean([r["new_over_base"] for r in table]),
        "geomean_fi_decode_drift": _geomean(drift) if drift else None,
    }


def to_markdown(result: dict[str, Any]) -> str:
    drift = result["geomean_fi_decode_drift"]
    lines = [
        f"geomean % of floor: base {result['geomean_pct_floor_base']:.1f}, "
        f"new {result['geomean_pct_floor_new']:.1f}; new/base time "
        f"{result['geomean_new_over_base']:.3f}"
        + (f"; FlashInfer decode new/base runs {drift:.3f}" if drift else ""),
        "",
        "| tree | heads | page | floor_us | base_us | new_us | new/base | fi_decode base/new us |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        fi = (f"{r['fi_decode_base_us']:.1f} / {r['fi_decode_new_us']:.1f}"
              if r["fi_decode_base_us"] and r["fi_decode_new_us"] else "")  # fmt: skip
        lines.append(
            f"| {r['tree']} | {r['heads'][0]},{r['heads'][1]} | {r['page_size']} | "
            f"{r['floor_us']:.1f} | {r['base_us']:.1f} | {r['new_us']:.1f} | "
            f"{r['new_over_base']:.3f} | {fi} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", nargs="+", required=True)
    ap.add_argument("--new", nargs="+", required=True)
    ap.add_argument("--out-md")
    ap.add_argument("--out-json")
    args = ap.parse_args(argv)
    result = compare(args.base, args.new)
    text = to_markdown(result)
    print(text)
    if args.out_md:
        Path(args.out_md).write_text(text)
    if args.out_json:
        Path(args.out_json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
