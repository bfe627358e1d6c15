"""Where a decode step's time goes, from a PyTorch profiler trace (Chrome JSON, ``.gz`` too).

Written for the traces vLLM (``profiler_config``) and SGLang (``start_profile``) save from
their model workers, with the adapters' named ranges ``prefixattn.host_tables`` (the copy of
the batch's block table to the host, which waits for the work queued before it) and
``prefixattn.plan``. Prints, as JSON:

- ``window_ms``: first GPU activity to last; ``gpu_busy_ms``: the union of GPU kernels,
  copies and sets in it; ``gpu_idle_ms`` and ``gpu_idle_frac``;
- ``gaps``: idle intervals of the GPU longer than ``--gap-us``, their count, total and the
  longest, each with the named prefixattn ranges that overlap it;
- ``ranges``: count, total and mean of each named range (CPU);
- ``attention_ms``: the attention kernels' device time (kernels of prefixattn, FlashInfer,
  FlashAttention and SGLang's Triton attention, by name, ``ATTENTION``) and ``kernels_ms``:
  the kernels with the most device time (names cut to 80 characters), over the whole trace;
- ``steps`` (with ``--step-marker NAME``, e.g. ``prefixattn.plan`` or ``cudaGraphLaunch``):
  the intervals between consecutive starts of that CPU event, as steps (``all_ms``: every
  interval's length). Over the steps no
  longer than twice the median (the steady decode steps): median step, GPU busy and idle
  time, the GPU kernels by device time per step (names cut to 80 characters), the attention
  kernels' time per step (``attention_ms_per_step``: kernels of prefixattn, FlashInfer,
  FlashAttention and SGLang's Triton attention, by name, ``ATTENTION``) and the rest of the
  step (``rest_ms_per_step``: median step minus attention), and the host
  events that overlap the GPU's idle gaps inside them (per step, by name,
  longest first): what the host was doing while the GPU waited; and ``step_kinds``: the
  same steps, all of them, by kind (one CUDA graph launch, several, none), with their host
  time and the device time of the kernels they launched (attention and the rest).

    python -m tools.trace_summary TRACE.json[.gz] [--gap-us 50] [--step-marker NAME] [--slim DIR]

``--slim DIR`` also writes each trace's slim copy (:func:`slim`: GPU work, named ranges and
launches only; the same summaries, in a tenth of the bytes or less).
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import itertools
import json
import re
import sys
import zlib
from pathlib import Path
from typing import Any

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATS = ("user_annotation", "cuda_runtime", "cuda_driver", "cpu_op", "python_function")
RANGES = ("prefixattn.host_tables", "prefixattn.plan")
# Substrings of attention kernel names: prefixattn's forward kernels (every tile height and
# head_dim) and merge, FlashInfer's decode, prefill and merge kernels, FlashAttention, SGLang's
# Triton decode/extend kernels.
ATTENTION = (
    "prefixattn::forward_", "prefixattn::merge_kernel", "BatchDecode", "BatchPrefill",
    "MergeState", "flash_fwd", "flash::", "_fwd_kernel", "_decode_att", "_decode_softmax",
    "_decode_grouped",
)  # fmt: skip


def is_attention(name: str) -> bool:
    return any(a in name for a in ATTENTION)


def load(path: Path) -> list[dict[str, Any]]:
    """The complete ("X") events of a trace; ``ValueError`` naming ``path`` when the file is
    cut off (a profiler stopped while writing it) or is not a trace."""
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        data = json.loads(raw)
    except (EOFError, gzip.BadGzipFile, zlib.error, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not a complete trace ({type(e).__name__}: {e})") from e
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def summarize(events: list[dict[str, Any]], gap_us: float = 50.0, top: int = 5) -> dict:
    gpu = _union(
        [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events
         if e.get("cat") in GPU_CATS]
    )  # fmt: skip
    named = {n: _host_ranges(events, n) for n in RANGES}
    ranges = {
        n: {"count": len(iv), "total_ms": round(sum(b - a for a, b in iv) / 1e3, 3),
            "mean_ms": round(sum(b - a for a, b in iv) / 1e3 / len(iv), 4) if iv else 0.0}
        for n, iv in named.items()
    }  # fmt: skip
    kernels: dict[str, float] = {}
    attention = 0.0
    for e in events:
        if e.get("cat") == "kernel":
            name = str(e["name"])
            kernels[name[:80]] = kernels.get(name[:80], 0.0) + float(e["dur"])
            if is_attention(name):
                attention += float(e["dur"])
    top_kernels = {
        k: round(v / 1e3, 3) for k, v in sorted(kernels.items(), key=lambda kv: -kv[1])[:12]
    }
    if not gpu:
        return {"window_ms": 0.0, "gpu_busy_ms": 0.0, "gpu_idle_ms": 0.0, "gpu_idle_frac": 0.0,
                "gaps": {"count": 0, "total_ms": 0.0, "longest": []}, "ranges": ranges,
                "attention_ms": 0.0, "kernels_ms": {}}  # fmt: skip
    window = gpu[-1][1] - gpu[0][0]
    busy = sum(b - a for a, b in gpu)
    gaps = [(a[1], b[0]) for a, b in itertools.pairwise(gpu) if b[0] - a[1] > gap_us]
    longest = sorted(gaps, key=lambda g: g[0] - g[1])[:top]

    def overlapping(start: float, end: float) -> dict[str, float]:
        out = {}
        for n, iv in named.items():
            us = sum(max(0.0, min(end, b) - max(start, a)) for a, b in iv)
            if us > 0:
                out[n] = round(us / 1e3, 3)
        return out

    return {
        "window_ms": round(window / 1e3, 3),
        "gpu_busy_ms": round(busy / 1e3, 3),
        "gpu_idle_ms": round((window - busy) / 1e3, 3),
        "gpu_idle_frac": round((window - busy) / window, 4) if window > 0 else 0.0,
        "gaps": {
            "min_us": gap_us,
            "count": len(gaps),
            "total_ms": round(sum(b - a for a, b in gaps) / 1e3, 3),
            "longest": [
                {"ms": round((b - a) / 1e3, 3), "overlaps_ms": overlapping(a, b)}
                for a, b in longest
            ],
        },
        "ranges": ranges,
        "attention_ms": round(attention / 1e3, 3),
        "kernels_ms": top_kernels,
    }


def steps_summary(
    events: list[dict[str, Any]], marker: str, gap_us: float = 50.0, top: int = 24
) -> dict[str, Any]:
    """Steady steps between starts of ``marker`` (a host event whose name starts with it):
    median length, GPU busy and idle, and the host events overlapping the idle gaps (ms per
    step, by ``cat/name``). Linear in the events, up to logarithms: a whole serving run's trace
    (millions of events) is summarised in seconds."""
    spans = list(itertools.pairwise(t for t, _ in _marks(events, marker)))
    if not spans:
        return {"marker": marker, "count": 0}
    lengths = sorted(b - a for a, b in spans)
    median = lengths[len(lengths) // 2]
    steady = [(a, b) for a, b in spans if b - a <= 2 * median]
    steady_starts = [a for a, _ in steady]
    gpu = _union(
        [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events
         if e.get("cat") in GPU_CATS]
    )  # fmt: skip
    gpu_starts = [a for a, _ in gpu]
    kernels: dict[str, float] = {}
    attention = 0.0
    for e in events:
        if e.get("cat") == "kernel":
            s0 = float(e["ts"])
            i = bisect.bisect_right(steady_starts, s0) - 1
            if i >= 0 and s0 < steady[i][1]:
                name = str(e["name"])[:80]
                kernels[name] = kernels.get(name, 0.0) + float(e["dur"])
                if is_attention(str(e["name"])):
                    attention += float(e["dur"])
    busy, idle = [], []
    gaps: list[tuple[float, float]] = []  # the steps' idle intervals over gap_us, in order
    for a, b in steady:
        first = max(0, bisect.bisect_right(gpu_starts, a) - 1)
        inside = []
        for lo, hi in gpu[first:]:
            if lo >= b:
                break
            if hi > a:
                inside.append((max(a, lo), min(b, hi)))
        step_busy = sum(hi - lo for lo, hi in inside)
        busy.append(step_busy)
        idle.append((b - a) - step_busy)
        edges = [a, *[x for iv in inside for x in iv], b]
        gaps += [(lo, hi) for lo, hi in zip(edges[::2], edges[1::2], strict=True)
                 if hi - lo > gap_us]  # fmt: skip
    # Idle time before t: prefix sums over the sorted, disjoint gaps.
    gap_starts = [lo for lo, _ in gaps]
    before = list(itertools.accumulate((hi - lo for lo, hi in gaps), initial=0.0))

    def idle_before(t: float) -> float:
        i = bisect.bisect_right(gap_starts, t) - 1
        return 0.0 if i < 0 else before[i] + min(t, gaps[i][1]) - gaps[i][0]

    during_idle: dict[str, float] = {}
    for e in events:
        if e.get("cat") in HOST_CATS:
            t0 = float(e["ts"])
            us = idle_before(t0 + float(e["dur"])) - idle_before(t0)
            if us > 0:
                key = f"{e['cat']}/{e['name']}"
                during_idle[key] = during_idle.get(key, 0.0) + us
    n = len(steady)

    def med(xs: list[float]) -> float:
        return round(sorted(xs)[len(xs) // 2] / 1e3, 3)

    ranked = sorted(during_idle.items(), key=lambda kv: -kv[1])[:top]
    step_ms = med([b - a for a, b in steady])
    return {
        "marker": marker,
        "all_ms": [round((b - a) / 1e3, 2) for a, b in spans],
        "count": n,
        "step_ms": step_ms,
        "attention_ms_per_step": round(attention / n / 1e3, 3),
        "rest_ms_per_step": round(step_ms - attention / n / 1e3, 3),
        "gpu_busy_ms": med(busy),
        "gpu_idle_ms": med(idle),
        "host_during_idle_ms_per_step": {k: round(v / n / 1e3, 3) for k, v in ranked},
        "kernels_ms_per_step": {
            k: round(v / n / 1e3, 3)
            for k, v in sorted(kernels.items(), key=lambda kv: -kv[1])[:top]
        },
    }


def _host_ranges(events: list[dict[str, Any]], name: str) -> list[tuple[float, float]]:
    """(start, end) of the host ranges named ``name``: the profiler also records a GPU-side
    copy of each named range (``gpu_user_annotation``, spanning the GPU work queued inside
    it), which is not host time."""
    return [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events
            if e.get("name") == name and e.get("cat") not in GPU_CATS
            and e.get("cat") != "gpu_user_annotation"]  # fmt: skip


def _marks(events: list[dict[str, Any]], marker: str) -> list[tuple[float, str]]:
    """(start, name) of the host events whose names start with ``marker``, in order."""
    return sorted((float(e["ts"]), str(e["name"])) for e in events
                  if str(e.get("name", "")).startswith(marker)
                  and e.get("cat") not in GPU_CATS and e.get("cat") != "gpu_user_annotation")  # fmt: skip


# vLLM's per-step profiler range (its worker's annotate_profile): requests and tokens of the
# step's prefill chunks ("context") and decodes ("generation").
VLLM_STEP = re.compile(r"execute_context_(\d+)\((\d+)\)_generation_(\d+)\((\d+)\)")


def step_kinds(events: list[dict[str, Any]], marker: str) -> dict[str, Any]:
    """Every step between consecutive starts of ``marker`` (a host event whose name starts
    with it), by kind. With vLLM's step range (``execute_context_``, :data:`VLLM_STEP`) the
    kind is what the step ran: ``decode`` (decodes only), ``prefill`` (prefill chunks only)
    or ``mixed``, with the prefill tokens and decode requests summed; otherwise it is how
    the step launched its work: ``graph`` (one CUDA graph launch), ``piecewise`` (several) or
    ``eager`` (none). Kernels belong to the step whose host span holds their launch (matched
    by the profiler's correlation id), so the GPU's lag behind the host does not move them
    into the next step. Per kind: steps, CUDA graph launches, host time (sum and median of
    the spans), the device time of the step's kernels, attention and the rest, and the host
    time of the ``prefixattn.plan`` ranges that start in the steps (``planning_ms``). The sums
    over the kinds account for the traced window between the first and the last marker."""
    marks = _marks(events, marker)
    spans = [(a, b, name) for (a, name), (b, _) in itertools.pairwise(marks)]
    if not spans:
        return {"marker": marker, "steps": 0, "kinds": {}}
    edges = [a for a, _, _ in spans]

    def step_of(ts: float) -> int | None:
        i = bisect.bisect_right(edges, ts) - 1
        return i if 0 <= i < len(spans) and ts < spans[i][1] else None

    launches = [0] * len(spans)
    launch_ts: dict[Any, float] = {}
    for e in events:
        if e.get("cat") not in ("cuda_runtime", "cuda_driver"):
            continue
        corr = (e.get("args") or {}).get("correlation")
        if corr is not None:
            launch_ts[corr] = float(e["ts"])
        if str(e.get("name", "")).startswith(("cudaGraphLaunch", "cuGraphLaunch")):
            i = step_of(float(e["ts"]))
            if i is not None:
                launches[i] += 1
    attention = [0.0] * len(spans)
    other = [0.0] * len(spans)
    for e in events:
        if e.get("cat") != "kernel":
            continue
        ts = launch_ts.get((e.get("args") or {}).get("correlation"))
        i = step_of(ts) if ts is not None else None
        if i is None:
            continue
        if is_attention(str(e["name"])):
            attention[i] += float(e["dur"])
        else:
            other[i] += float(e["dur"])
    planning = [0.0] * len(spans)  # host time of prefixattn's plans started in the step
    for a, b in _host_ranges(events, "prefixattn.plan"):
        i = step_of(a)
        if i is not None:
            planning[i] += b - a
    groups: dict[str, list[int]] = {}
    prefill_tokens: dict[str, int] = {}
    decodes: dict[str, int] = {}
    for i, (_, _, name) in enumerate(spans):
        m = VLLM_STEP.match(name)
        if m:
            ctx, ctx_tokens, gen = int(m[1]), int(m[2]), int(m[3])
            kind = "decode" if ctx == 0 else "prefill" if gen == 0 else "mixed"
            prefill_tokens[kind] = prefill_tokens.get(kind, 0) + ctx_tokens
            decodes[kind] = decodes.get(kind, 0) + gen
        else:
            n = launches[i]
            kind = "eager" if n == 0 else "graph" if n == 1 else "piecewise"
        groups.setdefault(kind, []).append(i)
    kinds: dict[str, dict[str, Any]] = {}
    for kind, idx in sorted(groups.items()):
        lengths = sorted(spans[i][1] - spans[i][0] for i in idx)
        kinds[kind] = {
            "steps": len(idx),
            "graph_launches": sum(launches[i] for i in idx),
            "host_ms": round(sum(lengths) / 1e3, 3),
            "median_ms": round(lengths[len(lengths) // 2] / 1e3, 3),
            "attention_ms": round(sum(attention[i] for i in idx) / 1e3, 3),
            "other_kernels_ms": round(sum(other[i] for i in idx) / 1e3, 3),
            "planning_ms": round(sum(planning[i] for i in idx) / 1e3, 3),
        }
        if kind in prefill_tokens:
            kinds[kind].update(prefill_tokens=prefill_tokens[kind], decodes=decodes[kind])
    return {
        "marker": marker,
        "steps": len(spans),
        "window_ms": round((marks[-1][0] - marks[0][0]) / 1e3, 3),
        "kinds": kinds,
    }


def summary(events: list[dict[str, Any]], gap_us: float, step_marker: str | None) -> dict:
    """:func:`summarize`, with ``steps`` and ``step_kinds`` when ``step_marker`` is given."""
    out = summarize(events, gap_us)
    if step_marker:
        out["steps"] = steps_summary(events, step_marker, gap_us)
        out["step_kinds"] = step_kinds(events, step_marker)
    return out


def summarize_traces(
    folder: Path, gap_us: float = 50.0, step_marker: str | None = None
) -> dict[str, dict]:
    """Summaries of every trace file below ``folder``, by relative path (with ``steps`` and
    ``step_kinds`` when ``step_marker`` is given)."""
    files = sorted(p for p in folder.rglob("*") if p.name.endswith((".json", ".json.gz")))
    out = {}
    for p in files:
        key = str(p.relative_to(folder))
        try:
            out[key] = summary(load(p), gap_us, step_marker)
        except (OSError, ValueError, KeyError) as e:
            out[key] = {"error": f"{type(e).__name__}: {e}"}
    return out


SLIM_CATS = (*GPU_CATS, "gpu_user_annotation", "user_annotation", "cuda_runtime", "cuda_driver")


def slim(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The events every summary here reads, with only the fields it reads: GPU work, the
    named ranges (steps, planning) and the CUDA launches with their correlation ids. The
    framework's per-operator events (``cpu_op``), most of a trace's bytes, are left out, so a
    serving run's trace becomes small enough to carry off a machine."""
    out = []
    for e in events:
        if e.get("cat") in SLIM_CATS:
            fields = ("ph", "name", "cat", "ts", "dur", "pid", "tid")
            kept: dict[str, Any] = {k: e[k] for k in fields if k in e}
            corr = (e.get("args") or {}).get("correlation")
            if corr is not None:
                kept["args"] = {"correlation": corr}
            out.append(kept)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="+", type=Path)
    ap.add_argument("--gap-us", type=float, default=50.0, help="shortest idle interval listed")
    ap.add_argument("--step-marker", help="host event that starts each step (adds 'steps')")
    ap.add_argument("--slim", type=Path, metavar="DIR",
                    help="also write each trace's slim copy (slim()) as DIR/NAME.slim.json.gz")  # fmt: skip
    args = ap.parse_args(argv)
    result = {}
    for p in args.traces:
        events = load(p)
        if args.slim is not None:
            args.slim.mkdir(parents=True, exist_ok=True)
            name = p.name.removesuffix(".gz").removesuffix(".json")
            data = json.dumps({"traceEvents": slim(events)}).encode()
            (args.slim / f"{name}.slim.json.gz").write_bytes(gzip.compress(data))
        result[str(p)] = summary(events, args.gap_us, args.step_marker)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
