"""Attention benchmark: prefixattn's CUDA kernels against the HBM floor (and FlashInfer).

``prefixattn bench [options]`` and ``benchmarks/bench_attention.py`` call :func:`main`.

The floor of one call = (bytes of the distinct KV entries + q and output bytes) / bandwidth of
a large device-to-device copy measured in the same run (read + written bytes). Every timed
call is preceded by a write of a buffer larger than L2 (cold L2, as between layers of a
model); the median over ``--iters`` calls is reported.

Beside the floor, each configuration gets what one launch can reach in the same harness
(``--no-ceiling`` skips it): ``copy_us``, a device-to-device copy that moves the floor's
bytes (half read, half written), timed in the same rounds as the kernels, so it carries the
launch, the ramp and the tail a kernel of that many bytes cannot avoid; and ``math_us``, the
attention's tensor-core FLOPs at the rate of a large bf16 matmul measured in the same run.
``ceiling_us`` is the larger of the two and ``pct_floor_ceiling`` the share of the floor it
reaches. It bounds what the launch costs and the math allow, not the bytes exactly: a kernel
that mostly reads can beat a copy's mix of reads and writes by a few percent on long calls.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .plan.tiles import SUPPORTED_HEAD_DIMS, TileTable
from .workloads import parse_heads, parse_tree

PAT_TREES = (
    "1,10_4096,416", "1,256_256,32", "1,1024_2048,32", "1,2,64_1024,256,256",
    "1,4,256_32,256,32", "1,8,512_32,512,256", "1,8,512_32,2048,256", "1,8,512_512,512,256",
    "1,4,8,256_32,256,256,32", "1,4,16,512_1024,256,128,32",
    "1,4,16,64,256,1024_256,32,256,64,32,256", "1,16,32,64,128,1024_256,128,64,32,32,32",
    "1,16,32,64,256,1024_256,128,64,32,32,32", "1,8,16,32,64,128,1024_256,128,64,32,32,32,32",
    "1,8,16,32,64,256,1024_256,128,64,32,32,32,32", "2,8,16,256_256,256,32,32",
    "4,16,256,512_512,32,128,32", "8,16,32,256_512,512,256,32", "256_1024", "256_4096",
)  # fmt: skip
"""The PAT paper's shared-prefix decode suite (Figure 10), in its B_L notation."""

HEADS = ((32, 32), (16, 8), (32, 8), (64, 8))


def _heads(text: str) -> tuple[int, int]:
    try:
        return parse_heads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _page_size(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= 128:
        raise argparse.ArgumentTypeError(f"wants a page size from 1 to 128, got {text!r}")
    return value


def _tree(text: str) -> str:
    try:
        parse_tree(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


@dataclasses.dataclass(frozen=True)
class Variant:
    """One timed form of prefixattn: the plan call's arguments, the options that differ from
    the defaults, and an edit of the tile table."""

    packing: str = "memory"
    split_kv: bool = True
    plan: dict[str, Any] = dataclasses.field(default_factory=dict)
    """:class:`prefixattn.PlanOptions` fields."""
    launch: dict[str, Any] = dataclasses.field(default_factory=dict)
    """:class:`prefixattn.LaunchOptions` fields."""
    tiles: str = ""
    """"one_tile": every item on the largest tile; "no_wide": items of 33-64 rows stay on the
    64-row tile whatever their KV length (``TileTable.wide_kv_len`` 0); "no_narrow": the
    default tile table alone (``TileTable.narrow_m_sizes`` empty); "": the default table."""

    def tile_table(self, table: TileTable) -> TileTable:
        if self.tiles == "one_tile":
            return TileTable(m_sizes=(table.max_rows,), n_by_kv_len=table.n_by_kv_len)
        if self.tiles == "no_wide":
            return dataclasses.replace(table, wide_kv_len=0)
        if self.tiles == "no_narrow":
            return dataclasses.replace(table, narrow_m_sizes=())
        return table


MAIN = Variant()
ABLATIONS: dict[str, Variant] = {
    "naive": Variant(packing="naive"),
    "per_query": Variant(packing="per_query"),
    "no_split": Variant(split_kv=False),
    # split every long item, whatever the SMs (split_target 0)
    "split_all": Variant(plan={"split_target": 0}),
    "one_tile": Variant(tiles="one_tile"),
    # each item keeps its own tile height in one-wave plans
    "per_height": Variant(plan={"one_launch_in_one_wave": False}),
    # the split rule's parts, not fewer where they fill whole waves
    "no_waves": Variant(plan={"split_waves": False}),
    # the leaf floor of the general one (PlanOptions.leaf_split_tokens = 256): small decode
    # batches in fewer, longer parts, host-sized and graph-capture grids
    "leaf_floor256": Variant(plan={"leaf_split_tokens": 256}),
    "fixed_leaf_floor256": Variant(plan={"leaf_split_tokens": 256}, launch={"fixed_grid": True}),
    # one lower split floor for every plan (PlanOptions.min_split_tokens and leaf_split_tokens)
    "split_floor64": Variant(plan={"min_split_tokens": 64, "leaf_split_tokens": 64}),
    "split_floor32": Variant(plan={"min_split_tokens": 32, "leaf_split_tokens": 32}),
    "split_floor16": Variant(plan={"min_split_tokens": 16, "leaf_split_tokens": 16}),
    # one KV head per (item, KV head) pair of the 16-row kernel
    "unpacked_heads": Variant(plan={"pack_heads": False}),
    "prefetch2": Variant(launch={"prefetch_tiles": 2}),
    # the plan-independent grids of graph capture
    "fixed_grid": Variant(launch={"fixed_grid": True}),
    "concurrent": Variant(launch={"concurrent_groups": True}),
    "fixed_concurrent": Variant(launch={"fixed_grid": True, "concurrent_groups": True}),
    # each launch waits for the one before it to finish
    "unchained": Variant(launch={"chain_launches": False}),
    # every merged token goes to the merge launch (the leaf launch runs first)
    "merge_all": Variant(plan={"finish_in_leaf": False}),
    "fixed_merge_all": Variant(plan={"finish_in_leaf": False}, launch={"fixed_grid": True}),
    "no_wide": Variant(tiles="no_wide"),
    "no_narrow": Variant(tiles="no_narrow"),
}
"""The ablations ``--ablations`` may time beside the default (``MAIN``)."""
PAGE1_TREES = ("1,10_4096,416", "1,4,16,512_1024,256,128,32", "256_1024")


def plan_traffic(plan: Any) -> dict[str, int]:
    """HBM bytes of one call of ``plan`` (one layer), from the plan's own accounting.

    - ``floor``: distinct KV entries plus q and the output: the benchmark's floor, what any
      kernel must move;
    - ``plan``: ``floor`` plus the partial rows the plan writes and the merge reads back: the
      least this plan moves, with every repeated read of a shared page (row chunks of one
      node, split parts) served from L2;
    - ``plan_reads``: ``plan`` with every repeated page read counted again (none served from
      L2).

    ``floor / plan`` is the share of the floor the plan can reach at the full bandwidth.
    """
    floor = plan.distinct_kv_bytes + plan.qo_bytes
    return {"floor": floor, "plan": floor + plan.partial_bytes,
            "plan_reads": plan.kv_bytes + plan.qo_bytes + plan.partial_bytes}  # fmt: skip


def suite_configs(
    trees: Sequence[str],
    heads: Sequence[tuple[int, int]],
    page_size: int,
    page1_trees: Sequence[str],
) -> list[tuple[str, tuple[int, int], int]]:
    """The benchmark's (tree, (q heads, KV heads), page size) configurations: every tree at
    every head configuration and ``page_size``, then ``page1_trees`` at 32/8 and page size 1."""
    configs = [(t, h, page_size) for t in trees for h in heads]
    return configs + [(t, (32, 8), 1) for t in page1_trees]


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="prefixattn bench", description=__doc__.splitlines()[0])
    ap.add_argument("--trees", nargs="*", type=_tree, default=list(PAT_TREES),
                    help="trees in the PAT notation (counts_tokens); default: the PAT suite")  # fmt: skip
    ap.add_argument("--heads", nargs="*", type=_heads, default=list(HEADS), metavar="QO/KV",
                    help="query and KV head pairs, e.g. 32/8 (32,8 is accepted too); default: "
                    + " ".join(f"{a}/{b}" for a, b in HEADS))  # fmt: skip
    ap.add_argument("--page-size", type=_page_size, default=16,
                    help="tokens per KV page (1 to 128), default 16")  # fmt: skip
    ap.add_argument("--page1-trees", nargs="*", type=_tree, default=list(PAGE1_TREES),
                    help="trees also run with page size 1 (heads 32/8)")  # fmt: skip
    ap.add_argument("--head-dim", type=int, default=128, choices=SUPPORTED_HEAD_DIMS,
                    help="head dimension, default 128")  # fmt: skip
    ap.add_argument("--iters", type=int, default=30, help="timed calls per variant (median)")
    ap.add_argument("--ablations", nargs="*", default=None, metavar="NAME",
                    help=f"also time these variants (all without names): {', '.join(ABLATIONS)}")  # fmt: skip
    ap.add_argument("--no-flashinfer", action="store_true",
                    help="skip the FlashInfer decode and cascade columns")  # fmt: skip
    ap.add_argument("--no-ceiling", action="store_true",
                    help="skip the copy of the floor's bytes and the matmul rate (see above)")  # fmt: skip
    ap.add_argument("--breakdown", type=int, default=0, metavar="CALLS",
                    help="also profile CALLS calls of prefixattn per configuration: device time "
                    "per kernel, and the span from its first kernel to its last")  # fmt: skip
    ap.add_argument("--out", default="prefixattn-results/bench_attention.json",
                    help="result JSON (a table and a plot are written beside it)")  # fmt: skip
    args = ap.parse_args(argv)
    if args.iters <= 0:
        ap.error(f"--iters must be positive, got {args.iters}")
    unknown = sorted(set(args.ablations or ()) - set(ABLATIONS))
    if unknown:
        ap.error(f"unknown ablations {unknown}; known: {', '.join(ABLATIONS)}")
    return args


class _Timer:
    def __init__(self, torch, iters: int) -> None:
        self.torch = torch
        self.iters = iters
        # Larger than the H200's 60 MB L2: writing it evicts the KV cache between calls.
        self.flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")

    # Untimed calls before timing: at least this many, for at least this long, so the GPU's
    # clocks have ramped up after a configuration's setup.
    WARMUP_CALLS, WARMUP_S = 3, 0.02

    def _warm(self, fn: Callable[[], object]) -> None:
        calls, start = 0, time.perf_counter()
        while calls < self.WARMUP_CALLS or time.perf_counter() - start < self.WARMUP_S:
            self.flush.zero_()
            fn()
            self.torch.cuda.synchronize()
            calls += 1

    # GPU cycles of a spin kernel queued between the L2 flush and the start event: the host
    # enqueues the timed call's launches while it spins, so the time measured is the GPU's
    # alone, never the host's launch overhead (about 100 us at the H200's clock).
    SPIN_CYCLES = 200_000

    def _once_us(self, fn: Callable[[], object]) -> float:
        torch = self.torch
        self.flush.zero_()
        torch.cuda._sleep(self.SPIN_CYCLES)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end) * 1e3)

    def median_us(self, fn: Callable[[], object]) -> float:
        self._warm(fn)
        return statistics.median(self._once_us(fn) for _ in range(self.iters))

    def interleaved_us(
        self, fns: dict[str, Callable[[], object]]
    ) -> tuple[dict[str, float], dict[str, str]]:
        """Median microseconds of each function, timed in ``iters`` rounds that call every
        function once, each round starting one function later than the previous one. A drift
        of the GPU's clocks or memory state during a configuration then spreads over all
        functions instead of favouring those timed last. A function that raises while warming
        up is left out; its error is returned instead."""
        errors: dict[str, str] = {}
        for name, fn in fns.items():
            try:
                self._warm(fn)
            except Exception as e:
                errors[name] = str(e)[:200]
        names = [n for n in fns if n not in errors]
        times: dict[str, list[float]] = {n: [] for n in names}
        for i in range(self.iters):
            k = i % max(1, len(names))
            for name in names[k:] + names[:k]:
                times[name].append(self._once_us(fns[name]))
        return {n: statistics.median(t) for n, t in times.items()}, errors


def attention_flops(lens: Sequence[int], num_qo_heads: int, head_dim: int) -> int:
    """Tensor-core FLOPs of one decode call: each query's q K^T and P V over its whole context
    (2 multiply-adds per key and dimension), whatever the sharing."""
    return 4 * head_dim * num_qo_heads * sum(int(n) for n in lens)


def ceiling_columns(floor_us: float, copy_us: float, math_us: float) -> dict[str, float]:
    """The most one launch reaches on a configuration: the slower of moving the floor's bytes
    (``copy_us``) and doing its math at the measured matmul rate (``math_us``)."""
    ceiling = max(copy_us, math_us)
    return {
        "math_us": math_us,
        "ceiling_us": ceiling,
        "pct_floor_ceiling": 100 * floor_us / ceiling,
    }


def matmul_flops(torch, timer: _Timer, n: int = 8192) -> float:
    """FLOP/s of an n x n x n bf16 matmul (the tensor cores' rate for the ceiling's math)."""
    a = torch.randn(n, n, device="cuda").to(torch.bfloat16)
    b = torch.randn(n, n, device="cuda").to(torch.bfloat16)
    us = timer.median_us(lambda: a @ b)
    return 2 * n**3 / (us * 1e-6)


def hbm_bandwidth(torch, timer: _Timer) -> float:
    """Bytes/s of a 2 GiB device-to-device copy (read + write counted)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = timer.median_us(lambda: dst.copy_(src))
    return 2 * (1 << 30) / (us * 1e-6)


def cascade_levels(
    forest: Any, table: np.ndarray, seq_lens: np.ndarray, page_size: int
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """The prefix forest as FlashInfer's multi-level cascade input: one level per tree depth,
    each ``(qo_indptr, kv_indptr, kv_indices, kv_last_page_len)`` over the requests in the
    forest's DFS order (``forest.order``: q rows must be permuted into it).

    Level ``i`` has one query segment per node at depth ``i`` (its requests) reading that
    node's own pages. Needs every request to have KV and to end where its leaf ends (a
    segment has one length), and every leaf at the same depth; raises ``ValueError``
    otherwise (the cascade has no empty segments).
    """
    n = forest.num_nodes
    if len(forest.order) != len(seq_lens):
        raise ValueError("a request without KV: no cascade segment for it")
    depth = forest.depth()
    leaf = np.array([not forest.children[u] for u in range(n)], dtype=bool)
    if len(forest.ending_reqs) != int(forest.req_end[leaf].sum() - forest.req_begin[leaf].sum()):
        raise ValueError("a request ends inside a shared node: no uniform cascade")
    if n == 0 or len(set(depth[leaf].tolist())) != 1:
        raise ValueError("leaves at different depths: no uniform cascade")
    for u in np.flatnonzero(leaf):
        reqs = forest.order[forest.req_begin[u] : forest.req_end[u]]
        if (seq_lens[reqs] != forest.token_end[u]).any():
            raise ValueError("requests of one leaf end at different lengths: no cascade segment")
    levels = []
    for lvl in range(int(depth.max()) + 1):
        nodes = np.flatnonzero(depth == lvl)
        nodes = nodes[np.argsort(forest.req_begin[nodes], kind="stable")]
        qo = np.concatenate(([0], forest.req_end[nodes])).astype(np.int32)
        if (
            qo[1:-1].tolist() != forest.req_begin[nodes][1:].tolist()
            or forest.req_begin[nodes[0]] != 0
        ):
            raise ValueError(f"level {lvl} does not cover every request once")
        pb, pe = forest.page_begin[nodes], forest.page_end[nodes]
        if (pe <= pb).any():
            raise ValueError(f"an empty node at level {lvl}")
        rows = forest.order[forest.req_begin[nodes]]
        indices = np.concatenate([table[r, b:e] for r, b, e in zip(rows, pb, pe, strict=True)])
        kv_indptr = np.concatenate(([0], np.cumsum(pe - pb))).astype(np.int32)
        last = (forest.token_end[nodes] - (pe.astype(np.int64) - 1) * page_size).astype(np.int32)
        levels.append((qo, kv_indptr, indices.astype(np.int32), last))
    return levels


def _flashinfer_cascade(torch, fi, plan, table, lens, ps, hq, hkv, d, q, k, v):
    """FlashInfer's MultiLevelCascadeAttentionWrapper over the plan's forest; returns the
    timed call and its output rows in request order."""
    levels = cascade_levels(plan.forest, table, lens, ps)
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    w = fi.MultiLevelCascadeAttentionWrapper(len(levels), workspace, "NHD")

    def dev(i: int) -> list:
        return [torch.from_numpy(lv[i]).to("cuda") for lv in levels]

    w.plan(dev(0), dev(1), dev(2), dev(3), hq, hkv, d, ps, q_data_type=q.dtype,
           kv_data_type=q.dtype)  # fmt: skip
    order = torch.from_numpy(plan.forest.order.astype(np.int64)).to("cuda")
    qp = q[order].contiguous()

    def output() -> Any:
        out = torch.empty_like(q)
        out[order] = w.run(qp, (k, v))
        return out

    return (lambda: w.run(qp, (k, v))), output


def _flashinfer_decode(torch, fi, table, lens, ps, hq, hkv, d, q, k, v):
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    w = fi.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
    npages = (lens + ps - 1) // ps
    indptr = torch.tensor(
        np.concatenate([[0], np.cumsum(npages)]), dtype=torch.int32, device="cuda"
    )
    indices = torch.tensor(np.concatenate([table[i, : npages[i]] for i in range(len(lens))]),
                           dtype=torch.int32, device="cuda")  # fmt: skip
    last = torch.tensor(lens - (npages - 1) * ps, dtype=torch.int32, device="cuda")
    w.plan(indptr, indices, last, hq, hkv, d, ps, data_type=q.dtype, q_data_type=q.dtype)
    return lambda: w.run(q, (k, v))


def _short_kernel_name(name: str) -> str:
    """``void prefixattn::forward_mma_kernel<__nv_bfloat16, 128, 4, 2, 3>(...)`` ->
    ``forward_mma_kernel<__nv_bfloat16, 128, 4, 2, 3>``."""
    name = name.split("(", 1)[0].removeprefix("void ").strip()
    return name.split("prefixattn::", 1)[-1]


def split_calls(events: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """prefixattn's kernel events per call, in start order, from a profiler trace's kernel
    events (``name``, ``ts``, ``dur`` in us). Calls are separated by any other kernel (the L2
    flush that precedes each call)."""
    calls: list[list[dict[str, Any]]] = []
    current: list[dict[str, Any]] = []
    for e in sorted(events, key=lambda e: float(e["ts"])):
        if "prefixattn::" in e["name"]:
            current.append(e)
        elif current:
            calls.append(current)
            current = []
    if current:
        calls.append(current)
    return calls


def kernel_breakdown(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-call device time of prefixattn's kernels from a profiler trace's kernel events
    (calls as in :func:`split_calls`). Returns the calls found, the median ``span_us`` (first
    kernel start to last kernel end of a call), the median ``busy_us`` (time with at least one
    of its kernels running) and, per kernel, launches per call and mean device us per call."""
    calls = [
        [(_short_kernel_name(e["name"]), float(e["ts"]), float(e["ts"]) + float(e["dur"]))
         for e in call]
        for call in split_calls(events)
    ]  # fmt: skip
    if not calls:
        return {"calls": 0}
    spans, busy = [], []
    per_kernel: dict[str, list[float]] = {}
    for call in calls:
        spans.append(max(e for _, _, e in call) - min(s for _, s, _ in call))
        merged_end, total = -math.inf, 0.0
        for _, start, end in sorted(call, key=lambda k: k[1]):
            total += max(0.0, end - max(start, merged_end))
            merged_end = max(merged_end, end)
        busy.append(total)
        for name, start, end in call:
            per_kernel.setdefault(name, []).append(end - start)
    n = len(calls)
    kernels = {
        name: {"per_call": round(len(d) / n, 2), "us": round(sum(d) / n, 2)}
        for name, d in sorted(per_kernel.items(), key=lambda kv: -sum(kv[1]))
    }
    return {"calls": n, "span_us": round(statistics.median(spans), 2),
            "busy_us": round(statistics.median(busy), 2), "kernels": kernels}  # fmt: skip


def profile_kernel_events(
    torch, fn: Callable[[], object], flush: Any, calls: int, spin_cycles: int = 0
) -> list[dict[str, Any]]:
    """Run ``fn`` ``calls`` times under torch's profiler, each after an L2 flush (and, with
    ``spin_cycles``, a GPU spin, as :class:`_Timer` does), and return the trace's kernel
    events (``name``, ``ts``, ``dur`` in us, ``args``)."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            flush.zero_()
            if spin_cycles:
                torch.cuda._sleep(spin_cycles)
            fn()
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        data = json.loads(path.read_text())
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("cat") == "kernel" and "dur" in e]


def profile_breakdown(torch, fn: Callable[[], object], flush: Any, calls: int) -> dict[str, Any]:
    """Run ``fn`` ``calls`` times (each after an L2 flush) under torch's profiler and
    summarize its kernels with :func:`kernel_breakdown`."""
    return kernel_breakdown(profile_kernel_events(torch, fn, flush, calls))


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    import torch

    import prefixattn
    from prefixattn.runtime.buffers import Workspace
    from prefixattn.runtime.launch import run_plan
    from prefixattn.runtime.library import cuda_ops_available
    from prefixattn.workloads import tree_batch

    if not torch.cuda.is_available() or not cuda_ops_available():
        print("prefixattn bench: needs a CUDA GPU and the CUDA kernels", file=sys.stderr)
        return 1
    fi: Any = None
    if not args.no_flashinfer:
        try:
            fi = importlib.import_module("flashinfer")
        except ImportError:
            print("flashinfer not importable: FlashInfer columns skipped", file=sys.stderr)
    timer = _Timer(torch, args.iters)
    bw = hbm_bandwidth(torch, timer)
    print(f"HBM bandwidth (D2D copy): {bw / 1e9:.0f} GB/s")
    flops = None if args.no_ceiling else matmul_flops(torch, timer)
    if flops is not None:
        print(f"bf16 matmul: {flops / 1e12:.0f} TFLOP/s")
    dtype, d = torch.bfloat16, args.head_dim
    rows = []
    heads = args.heads
    configs = suite_configs(args.trees, heads, args.page_size, args.page1_trees)
    for spec, (hq, hkv), ps in configs:
        table, lens = tree_batch(spec, ps, seed=0)
        num_pages = int(table.max()) + 1
        gen = torch.Generator(device="cuda").manual_seed(0)
        k = torch.randn(num_pages, ps, hkv, d, generator=gen, device="cuda").to(dtype)
        v = torch.randn(num_pages, ps, hkv, d, generator=gen, device="cuda").to(dtype)
        q = torch.randn(len(lens), hq, d, generator=gen, device="cuda").to(dtype)
        out = torch.empty_like(q)
        scale = 1 / math.sqrt(d)
        row: dict[str, Any] = {"tree": spec, "heads": [hq, hkv], "page_size": ps}
        variants: list[tuple[str, Variant]] = [("prefixattn", MAIN)]
        if args.ablations is not None:
            variants += [(n, ABLATIONS[n]) for n in args.ablations or ABLATIONS]
        calls: dict[str, Callable[[], object]] = {}
        # One partials workspace for every variant, so that no variant's timing depends on
        # where its own scratch happens to lie in memory.
        ws = Workspace("cuda")
        for name, variant in variants:
            pa = prefixattn.PrefixAttention(
                hq, hkv, d, ps, device="cuda", dtype=dtype,
                plan_options=prefixattn.PlanOptions(**variant.plan),
                launch_options=prefixattn.LaunchOptions(**variant.launch),
            )  # fmt: skip
            pa.tiles = variant.tile_table(pa.tiles)
            plan = pa.plan(table, lens, packing=variant.packing, split_kv=variant.split_kv)
            # A fixed grid launches what PrefixAttention.run launches under one (a CUDA
            # graph's launches): the variants of plans of this many tokens.
            fixed = pa.launch_options.fixed_grid and not pa.launch_options.concurrent_groups
            calls[name] = functools.partial(
                run_plan, plan, q, k, v, out, scale, ws, pa.launch_options,
                finish=pa.finish_in_leaf,
                fixed_variants=pa._fixed_launches(len(q)) if fixed else -1,
            )  # fmt: skip
            if name == "prefixattn":
                pa_main, main_plan = pa, plan
                traffic = plan_traffic(plan)
                row["floor_us"] = traffic["floor"] / bw * 1e6
                row["plan_floor_us"] = traffic["plan"] / bw * 1e6
                row["items"] = plan.num_work_items
                row["tiles"] = plan.summary()
        if flops is not None:
            # Moves the floor's bytes: half of them read, half written.
            half = traffic["floor"] // 2
            src = torch.empty(half, dtype=torch.uint8, device="cuda")
            dst = torch.empty_like(src)
            calls["copy"] = functools.partial(dst.copy_, src)
        if fi is not None and ps > 0:
            try:
                calls["fi_decode"] = _flashinfer_decode(
                    torch, fi, table, lens, ps, hq, hkv, d, q, k, v
                )
            except Exception as e:
                row["fi_decode_error"] = str(e)[:200]
            try:
                call, output = _flashinfer_cascade(torch, fi, main_plan, table, lens, ps, hq,
                                                   hkv, d, q, k, v)  # fmt: skip
                # Same inputs, same math: the cascade's output must match prefixattn's.
                pa_main.run(q, k, v, out=out)
                diff = float((output().float() - out.float()).abs().max())
                row["fi_cascade_max_diff"] = diff
                if not diff <= 0.05 * max(1.0, float(out.float().abs().max())):
                    raise RuntimeError(f"cascade output differs from prefixattn's by {diff}")
                calls["fi_cascade"] = call
            except Exception as e:
                row["fi_cascade_error"] = str(e)[:200]
        # Every variant and baseline of a configuration in the same interleaved rounds.
        timed, errors = timer.interleaved_us(calls)
        if "prefixattn" in errors:
            raise RuntimeError(f"prefixattn failed on {spec} {hq},{hkv}: {errors['prefixattn']}")
        row.update({f"{n}_us": us for n, us in timed.items()})
        row.update({f"{n}_error": e for n, e in errors.items()})
        if args.breakdown > 0:
            row["breakdown"] = profile_breakdown(
                torch, calls["prefixattn"], timer.flush, args.breakdown
            )
        row["pct_floor"] = 100 * row["floor_us"] / row["prefixattn_us"]
        if flops is not None:
            math_us = attention_flops(lens.tolist(), hq, d) / flops * 1e6
            row.update(ceiling_columns(row["floor_us"], row["copy_us"], math_us))
        rows.append(row)
        extra = " ".join(f"{k_}={v_:.1f}" for k_, v_ in row.items() if k_.endswith("_us"))
        print(f"{spec:48s} {hq},{hkv} p{ps}: {extra} floor%={row['pct_floor']:.0f}", flush=True)
        if row.get("breakdown", {}).get("calls"):
            bd = row["breakdown"]
            parts = ", ".join(
                f"{k} x{v['per_call']:g}: {v['us']:.1f}" for k, v in bd["kernels"].items()
            )
            print(
                f"    span {bd['span_us']:.1f} us, busy {bd['busy_us']:.1f} us; {parts}", flush=True
            )
        # Rewritten after every configuration: a run cut short keeps what it measured.
        result = _write(torch, bw, rows, Path(args.out))
    if not rows:
        print("prefixattn bench: no configurations selected", file=sys.stderr)
        return 2
    print(f"geomean % of floor: {result['geomean_pct_floor']:.1f}")
    if "geomean_pct_floor_ceiling" in result:
        print(f"geomean % of floor one launch reaches (ceiling): "
              f"{result['geomean_pct_floor_ceiling']:.1f}")  # fmt: skip
    _plot(result, Path(args.out).with_suffix(".png"))
    return 0


def geomean(values: Sequence[float]) -> float:
    return math.exp(statistics.fmean(math.log(v) for v in values))


def summarize(device: str, bw: float, rows: list[dict]) -> dict:
    """The run's result: its rows, the geomean % of floor, and where every row has a ceiling,
    the ceiling's geomean % of floor and prefixattn's geomean % of the ceiling."""
    result: dict[str, Any] = {"device": device, "hbm_gbps": bw / 1e9,
                              "geomean_pct_floor": geomean([r["pct_floor"] for r in rows])}  # fmt: skip
    if rows and all("ceiling_us" in r for r in rows):
        result["geomean_pct_floor_ceiling"] = geomean([r["pct_floor_ceiling"] for r in rows])
        result["geomean_pct_ceiling"] = geomean(
            [100 * r["ceiling_us"] / r["prefixattn_us"] for r in rows]
        )
    result["rows"] = rows
    return result


def _write(torch, bw: float, rows: list[dict], out_path: Path) -> dict:
    result = summarize(torch.cuda.get_device_name(), bw, rows)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=1))
    _write_table(result, out_path.with_suffix(".md"))
    return result


def _write_table(result: dict, path: Path) -> None:
    cols = [c for c in ("floor_us", "plan_floor_us", "prefixattn_us", "fi_decode_us", "fi_cascade_us", "naive_us",
                        "per_query_us", "no_split_us", "split_all_us", "no_waves_us", "one_tile_us",
                        "prefetch2_us", "fixed_grid_us", "concurrent_us",
                        "fixed_concurrent_us", "unchained_us", "tile16_us", "merge_all_us", "fixed_merge_all_us",
                        "wide_leaf_us", "copy_us", "math_us", "ceiling_us")
            if any(c in r for r in result["rows"])]  # fmt: skip
    ceiling = "geomean_pct_floor_ceiling" in result
    head = (f"{result['device']}, HBM {result['hbm_gbps']:.0f} GB/s, bf16, head_dim 128; "
            f"geomean {result['geomean_pct_floor']:.1f}% of floor")  # fmt: skip
    if ceiling:
        head += (f"; one launch's ceiling {result['geomean_pct_floor_ceiling']:.1f}% of floor; "
                 f"prefixattn {result['geomean_pct_ceiling']:.1f}% of the ceiling")  # fmt: skip
    extra = " | ceiling % floor" if ceiling else ""
    lines = [head, "", "| tree | heads | page | " + " | ".join(cols) + " | % floor" + extra + " |",
             "|---|---|---|" + "---|" * len(cols) + "---|" + ("---|" if ceiling else "")]  # fmt: skip
    for r in result["rows"]:
        vals = " | ".join(f"{r[c]:.1f}" if c in r else "-" for c in cols)
        tail = f" | {r['pct_floor_ceiling']:.0f}" if ceiling else ""
        lines.append(f"| {r['tree']} | {r['heads'][0]},{r['heads'][1]} | {r['page_size']} | "
                     f"{vals} | {r['pct_floor']:.0f}{tail} |")  # fmt: skip
    path.write_text("\n".join(lines) + "\n")


def _plot(result: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(max(8, len(rows) * 0.25), 4))
    x = np.arange(len(rows))
    ax.bar(x, [r["pct_floor"] for r in rows], label="prefixattn")
    for key, style, label in (("fi_decode_us", "r.", "FlashInfer batch decode"),
                              ("fi_cascade_us", "gx", "FlashInfer multi-level cascade")):  # fmt: skip
        if any(key in r for r in rows):
            ax.plot(x, [100 * r["floor_us"] / r[key] if key in r else np.nan for r in rows],
                    style, label=label)  # fmt: skip
    if any("pct_floor_ceiling" in r for r in rows):
        ax.plot(x, [r.get("pct_floor_ceiling", np.nan) for r in rows], "k_",
                label="one launch's ceiling (copy of the floor's bytes, matmul rate)")  # fmt: skip
    ax.axhline(80, color="k", lw=0.5)
    ax.set_ylabel("% of HBM floor")
    ax.set_xticks(x, [f"{r['tree']} {r['heads'][0]}/{r['heads'][1]} p{r['page_size']}"
                      for r in rows], rotation=90, fontsize=5)  # fmt: skip
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=150)
