"""Plot the end-to-end decode step times of both engines' benchmarks (one run each).

Reads the JSON of ``tools/vllm/bench_decode.py`` and ``tools/sglang/bench_decode.py``
and draws, per engine, the decode step time of every backend for every workload. Each panel
is titled with the engine version the result recorded (``engine_version``).

    python -m tools.plot_e2e VLLM_RESULT.json SGLANG_DIR/bench_decode.json --out decode_step.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tools import RESULTS

# Step times: engine -> workload -> backend -> ms.
Table = dict[str, dict[str, dict[str, float]]]
# prefixattn's name in each engine: drawn first, in the same colour in every panel.
OURS = ("CUSTOM", "prefixattn")
LABEL = {"CUSTOM": "CUSTOM (prefixattn)"}


def vllm_steps(result: dict, batch: int = 256) -> dict[str, dict[str, float]]:
    """workload -> backend -> ms from a vLLM ``bench_decode.py`` result."""
    out: dict[str, dict[str, float]] = {}
    for backend, per in result["step_ms"].items():
        for workload, by_batch in per.items():
            if str(batch) in by_batch:
                out.setdefault(workload, {})[backend] = by_batch[str(batch)]
    return out


def sglang_steps(result: dict) -> dict[str, dict[str, float]]:
    """workload -> backend -> ms from an SGLang ``bench_decode.py`` result."""
    out: dict[str, dict[str, float]] = {}
    for backend, data in result["backends"].items():
        for workload, ms in data.get("step_ms", {}).items():
            out.setdefault(workload, {})[backend] = ms
    return out


def engine_label(name: str, result: dict) -> str:
    """``name`` and the version the benchmark recorded, e.g. ``vLLM 0.33.0``."""
    version = result.get("engine_version")
    return f"{name} {version}" if version else name


def decode_table(vllm_json: Path | None, sglang_json: Path | None) -> Table:
    table: Table = {}
    if vllm_json is not None:
        result = json.loads(vllm_json.read_text())
        table[engine_label("vLLM", result)] = vllm_steps(result)
    if sglang_json is not None:
        result = json.loads(sglang_json.read_text())
        table[engine_label("SGLang", result)] = sglang_steps(result)
    return table


def plot(table: Table, out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(table), figsize=(6 * len(table), 4), squeeze=False)
    for ax, (engine, per) in zip(axes[0], table.items(), strict=True):
        workloads = list(per)
        names = {b for w in per.values() for b in w}
        backends = [b for b in OURS if b in names] + sorted(names - set(OURS))
        width = 0.8 / len(backends)
        for i, backend in enumerate(backends):
            xs = [k + i * width for k in range(len(workloads))]
            ys = [per[w].get(backend, 0.0) for w in workloads]
            bars = ax.bar(xs, ys, width, label=LABEL.get(backend, backend), color=f"C{i}")
            ax.bar_label(bars, fmt="%.1f", fontsize=7)
        ax.set_xticks([k + width * (len(backends) - 1) / 2 for k in range(len(workloads))])
        ax.set_xticklabels(workloads)
        ax.set_ylabel("decode step (ms)")
        ax.set_title(engine)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("vllm_json", type=Path, nargs="?")
    ap.add_argument("sglang_json", type=Path, nargs="?")
    ap.add_argument("--out", type=Path, default=RESULTS / "decode_step.png",
                    help=f"PNG file (default {RESULTS}/decode_step.png)")  # fmt: skip
    ap.add_argument(
        "--title",
        default="Decode step time, 8B-Llama shape, 256 requests, H200 (lower is better)",
    )
    args = ap.parse_args(argv)
    table = decode_table(args.vllm_json, args.sglang_json)
    if not table:
        ap.error("give at least one result file")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    plot(table, args.out, args.title)
    print(json.dumps(table, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
