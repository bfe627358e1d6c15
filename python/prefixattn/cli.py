"""``prefixattn`` command line: ``demo``, ``plan-bench``, ``bench``, ``info`` and ``build``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Iterator

import numpy as np
import torch

from .attention import MAX_PAGE_SIZE, PrefixAttention
from .plan.packing import PACKINGS
from .plan.tiles import SUPPORTED_HEAD_DIMS
from .runtime import library
from .runtime.reference import attention_reference
from .workloads import TreeSpec, parse_heads, parse_tree, tree_batch

DEFAULT_TREE = "1,4,64_1024,256,128"
HEADS_HELP = "query and KV heads as QO/KV, e.g. 32/8 (32,8 is accepted too)"


def parse_heads_arg(text: str) -> tuple[int, int]:
    """``--heads`` of every command: ``32/8`` (or ``32,8``)."""
    try:
        return parse_heads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_tree_arg(text: str) -> TreeSpec:
    """``--tree``: a tree in the PAT notation (counts_tokens)."""
    try:
        return parse_tree(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"wants a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"wants a positive integer, got {text!r}")
    return value


def page_size_arg(text: str) -> int:
    value = positive_int(text)
    if value > MAX_PAGE_SIZE:
        raise argparse.ArgumentTypeError(f"page size {value} is larger than {MAX_PAGE_SIZE}")
    return value


def page_sizes_arg(text: str) -> tuple[int, ...]:
    return tuple(page_size_arg(x) for x in text.split(","))


def _dtype(name: str) -> torch.dtype:
    table = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    if name not in table:
        raise argparse.ArgumentTypeError(f"--dtype must be one of {', '.join(table)}")
    return table[name]


def demo(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="prefixattn demo",
        description="Plan a shared-prefix batch, show its forest and bytes, run and check it.",
    )
    parser.add_argument("--tree", type=parse_tree_arg, default=DEFAULT_TREE,
                        help="PAT tree notation (counts_tokens), default %(default)s")  # fmt: skip
    parser.add_argument("--heads", type=parse_heads_arg, default=(32, 8), help=HEADS_HELP)
    parser.add_argument("--head-dim", type=int, default=128, choices=SUPPORTED_HEAD_DIMS)
    parser.add_argument("--page-size", type=page_size_arg, default=16,
                        help=f"tokens per KV page, 1 to {MAX_PAGE_SIZE}")  # fmt: skip
    parser.add_argument("--dtype", type=_dtype, default=None, help="bf16, fp16 or fp32")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    try:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError as e:
        parser.error(f"--device: {e}")
    if device.type not in ("cuda", "cpu"):
        parser.error(f"--device must be cuda or cpu, got {args.device!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available")
    dtype = args.dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    hq, hkv = args.heads
    tree = args.tree
    block_table, seq_lens = tree_batch(tree, args.page_size, seed=args.seed)
    pa = PrefixAttention(hq, hkv, args.head_dim, args.page_size, device=device, dtype=dtype)
    library.load_library()  # compiled on first use: not part of the plan times below

    print(
        f"tree {tree}: {tree.batch_size} requests of {tree.seq_len} tokens, "
        f"heads {hq}/{hkv}, head_dim {args.head_dim}, page_size {args.page_size}, "
        f"{str(dtype).replace('torch.', '')} on {device}"
    )
    plans = {}
    for packing in PACKINGS:
        t0 = time.perf_counter()
        plans[packing] = pa.plan(block_table, seq_lens, packing=packing)
        plans[packing + "_ms"] = (time.perf_counter() - t0) * 1e3  # type: ignore[assignment]
    plan = pa.plan(block_table, seq_lens, packing="memory")
    print("\nprefix forest:")
    print(plan.forest.describe())
    print(
        f"\n{'packing':<10} {'items':>6} {'ctas':>6} {'KV MB':>9} {'partial MB':>10} "
        f"{'total MB':>9} {'vs query-centric KV':>20} {'plan ms':>8}"
    )
    for packing in PACKINGS:
        p = plans[packing]
        print(
            f"{packing:<10} {p.num_work_items:>6} {p.num_ctas:>6} {p.kv_bytes / 1e6:>9.2f} "
            f"{p.partial_bytes / 1e6:>10.2f} {p.total_bytes / 1e6:>9.2f} "
            f"{p.query_centric_kv_bytes / max(p.kv_bytes, 1):>19.2f}x "
            f"{plans[packing + '_ms']:>8.2f}"
        )
    print(
        f"distinct KV: {plan.distinct_kv_bytes / 1e6:.2f} MB; "
        f"tiles (m x n: items): "
        + ", ".join(
            f"{m}x{n}: {plan.tile_indptr[i + 1] - plan.tile_indptr[i]}"
            for i, (m, n) in enumerate(plan.tiles)
        )
    )

    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    num_pages = int(block_table.max()) + 1
    shape = (num_pages, args.page_size, hkv, args.head_dim)
    k_cache = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    v_cache = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    q = torch.randn((plan.num_tokens, hq, args.head_dim), generator=gen).to(device, dtype)
    out = pa.run(q, k_cache, v_cache)
    engine = "PyTorch reference"
    kernels = device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)
    if kernels and library.cuda_ops_available():
        engine = "CUDA kernels"
    bt = torch.from_numpy(block_table).to(device)
    sl = torch.from_numpy(seq_lens).to(device)
    ref = attention_reference(q, k_cache, v_cache, bt, sl)
    err = (out.float() - ref).abs().max().item()
    # Tolerance: a few units of the output dtype's rounding on values of magnitude ~1.
    tol = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 2e-2}[dtype]
    ok = err <= tol
    print(
        f"\nran with the {engine}: max |out - plain attention| = {err:.2e} "
        f"(tolerance {tol:.0e}) -> {'OK' if ok else 'MISMATCH'}"
    )
    return 0 if ok else 1


def plan_bench(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="prefixattn plan-bench", description="Time plan construction (host, one core)."
    )
    parser.add_argument("--tree", type=parse_tree_arg, default="1,16,256_2048,1024,1024",
                        help="PAT tree notation (counts_tokens), default %(default)s")  # fmt: skip
    parser.add_argument("--heads", type=parse_heads_arg, default=(32, 8), help=HEADS_HELP)
    parser.add_argument("--page-sizes", type=page_sizes_arg, default=(16, 1),
                        help="comma-separated page sizes, default 16,1")  # fmt: skip
    parser.add_argument("--repeat", type=positive_int, default=50, help="plans timed per case")
    parser.add_argument("--packing", default="memory", choices=PACKINGS)
    parser.add_argument(
        "--impl", default="both", choices=("native", "python", "both"),
        help="compiled planner, the Python reference implementation, or both",
    )  # fmt: skip
    parser.add_argument(
        "--no-narrow", action="store_true",
        help="plan with the default tile table alone (no narrow alternative plan)",
    )  # fmt: skip
    parser.add_argument(
        "--chunk", type=_chunk_arg, metavar="TOKENS,CONTEXT",
        help="instead of --tree: one request's prefill chunk of TOKENS new tokens into a "
        "CONTEXT-token context (e.g. 16384,1048576); also reports the host memory it takes",
    )  # fmt: skip
    parser.add_argument(
        "--decode-run", type=_decode_run_arg, metavar="REQUESTS,SHARED,PRIVATE",
        help="instead of --tree: an engine's decode run of REQUESTS requests sharing a "
        "SHARED-token prefix, each with PRIVATE tokens of its own, planned step by step as the "
        "engine adapters plan them (StepPlanner, block table on --device); host time per step",
    )  # fmt: skip
    parser.add_argument(
        "--finish-every", type=positive_int, default=None, metavar="K",
        help="with --decode-run: one request finishes every K steps (the batch shrinks, its "
        "rows close up in order, as after requests of different output lengths)",
    )  # fmt: skip
    parser.add_argument(
        "--device", default=None,
        help="with --decode-run: where the block table lives (default cuda if available)",
    )  # fmt: skip
    parser.add_argument(
        "--profile", type=positive_int, default=0, metavar="N",
        help="with --decode-run: print the N functions with the most cumulative time",
    )  # fmt: skip
    args = parser.parse_args(argv)
    hq, hkv = args.heads
    if args.chunk is not None:
        return _chunk_bench(args, hq, hkv)
    if args.decode_run is not None:
        return _decode_run_bench(args, hq, hkv)
    tree = args.tree
    print(
        f"tree {tree}: {tree.batch_size} requests x {tree.seq_len} tokens, packing {args.packing}"
    )
    for ps in args.page_sizes:
        bt, sl = tree_batch(tree, ps)
        pa = PrefixAttention(hq, hkv, 128, ps)
        if args.no_narrow:
            pa.tiles = dataclasses.replace(pa.tiles, narrow_m_sizes=())
        for impl in _planners(pa, args.impl, ps):
            times = []
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                pa.plan(bt, sl, packing=args.packing)
                times.append(time.perf_counter() - t0)
            t = np.asarray(times) * 1e3
            items = pa.last_plan.num_work_items if pa.last_plan else 0
            print(
                f"page_size {ps:>3} {impl:>6}: block table {bt.shape[0]}x{bt.shape[1]}, "
                f"plan median {np.median(t):.3f} ms (min {t.min():.3f}, "
                f"p90 {np.percentile(t, 90):.3f}) over {args.repeat} runs, {items} items"
            )
    return 0


def _planners(pa: PrefixAttention, impl: str, ps: int) -> Iterator[str]:
    """Set ``pa`` to each planner ``impl`` names ("native", "python" or "both") in turn, and
    yield its name; a native planner that is not built is reported and skipped."""
    for name in ("native", "python") if impl == "both" else (impl,):
        pa.native_plan = name == "native"
        if name == "native" and not library.native_plan_available():
            print(f"page_size {ps:>3}: the native planner is not built")
            continue
        yield name


def _chunk_arg(text: str) -> tuple[int, int]:
    try:
        tokens, context = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TOKENS,CONTEXT, got {text!r}") from None
    if not 0 < tokens <= context < 2**31:
        raise argparse.ArgumentTypeError(
            f"need 0 < TOKENS <= CONTEXT < 2**31, got {tokens},{context}"
        )
    return tokens, context


def _chunk_bench(args: argparse.Namespace, hq: int, hkv: int) -> int:
    """Plan one prefill chunk into a long context: time and peak host memory growth (the
    process's maximum resident set, so the first plan of the largest case shows it)."""
    import resource

    tokens, context = args.chunk
    rng = np.random.default_rng(0)
    print(f"prefill chunk of {tokens} tokens into a {context}-token context, heads {hq}/{hkv}")
    for ps in args.page_sizes:
        cols = -(-context // ps)
        table = rng.permutation(cols).astype(np.int32)[None, :]
        lens, indptr = np.array([context]), np.array([0, tokens])
        pa = PrefixAttention(hq, hkv, 128, ps)
        for impl in _planners(pa, args.impl, ps):
            pa.plan(table[:, : min(cols, 64)], np.array([min(context, 64 * ps)]), np.array([0, 1]))
            rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            times = []
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                pa.plan(table, lens, indptr)
                times.append(time.perf_counter() - t0)
            grew = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024  # KiB
            t = np.asarray(times) * 1e3
            plan = pa.last_plan
            assert plan is not None
            print(
                f"page_size {ps:>3} {impl:>6}: plan median {np.median(t):.1f} ms (min "
                f"{t.min():.1f}) over {args.repeat} runs, peak memory growth {grew:.0f} MiB, "
                f"{plan.num_work_items} items, {len(plan.host.kv_pages)} page ids"
            )
    return 0


def _decode_run_arg(text: str) -> tuple[int, int, int]:
    try:
        requests, shared, private = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected REQUESTS,SHARED,PRIVATE, got {text!r}"
        ) from None
    if not (0 < requests <= 4096 and shared >= 0 and private > 0 and shared + private < 2**24):
        raise argparse.ArgumentTypeError(
            "need 0 < REQUESTS <= 4096, SHARED >= 0, PRIVATE > 0 and SHARED + PRIVATE < 2**24, "
            f"got {text}"
        )
    return requests, shared, private


def _decode_run_bench(args: argparse.Namespace, hq: int, hkv: int) -> int:
    """Plan ``--repeat`` decode steps of one batch the way the engine adapters do
    (:class:`~prefixattn.engine.step.StepPlanner`): each step one more token per request,
    the block table on ``--device``; with ``--finish-every K`` one request leaves every K
    steps (its row removed, the later rows moved up, requests known by id). Reports the host
    time of each plan kind, apart for steps whose batch changed; on CUDA also the time until
    the plan's device work is done."""
    import cProfile
    import pstats

    from .engine.step import StepPlanner

    requests, shared, private = args.decode_run
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    steps = args.repeat
    for ps in args.page_sizes:
        # Row r: the shared pages, then its own pages for the whole run (the tables an
        # engine keeps: a request's row holds the pages it will fill).
        shared_cols = shared // ps  # a partly filled last page is private
        cols = -(-(shared + private + steps) // ps)
        table = np.empty((requests, cols), dtype=np.int32)
        table[:, :shared_cols] = np.arange(shared_cols)
        own = cols - shared_cols
        table[:, shared_cols:] = shared_cols + np.arange(requests * own).reshape(requests, own)
        device_table = torch.from_numpy(table).to(device)
        seq_lens = np.full(requests, shared + private, dtype=np.int64)
        indptr = np.arange(requests + 1, dtype=np.int64)

        def new_attention(ps: int = ps) -> PrefixAttention:
            return PrefixAttention(hq, hkv, 128, ps, device=device)

        planner = StepPlanner(new_attention, ps)
        attention = planner.attention_for(graph=False)
        host: dict[str, list[float]] = {}
        done: dict[str, list[float]] = {}
        profiler = cProfile.Profile() if args.profile else None
        ids = np.arange(requests)  # the running requests, in row order
        rng = np.random.default_rng(0)
        every = args.finish_every
        for step in range(steps):
            changed = bool(every) and step > 0 and step % every == 0 and len(ids) > 1
            if changed:  # one request leaves; the rows after it move up
                gone = int(rng.integers(len(ids)))
                ids, seq_lens = np.delete(ids, gone), np.delete(seq_lens, gone)
                device_table = torch.from_numpy(np.ascontiguousarray(table[ids])).to(device)
            n = len(ids)
            step_indptr = indptr[: n + 1]
            step_ids = ids if every else None  # requests known by id once rows move
            choice = planner.choose(n, decode=True)
            if cuda:
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            if profiler is not None:
                profiler.enable()
            if choice.device_table:
                planner.plan_device(
                    attention, choice, device_table, seq_lens, step_indptr, num_real=n,
                    ids=step_ids,
                )  # fmt: skip
            else:
                planner.plan_host(
                    attention, table[ids], seq_lens, step_indptr, num_real=n, ids=step_ids
                )
            if profiler is not None:
                profiler.disable()
            t1 = time.perf_counter()
            if cuda:
                torch.cuda.synchronize(device)
            t2 = time.perf_counter()
            kind = choice.kind + (" (batch changed)" if changed else "")
            host.setdefault(kind, []).append((t1 - t0) * 1e3)
            done.setdefault(kind, []).append((t2 - t0) * 1e3)
            seq_lens = seq_lens + 1
        print(
            f"decode run: {requests} requests, {shared} shared + {private} private tokens, "
            f"page_size {ps}, {steps} steps on {device}"
            + (f", one request leaving every {every} steps" if every else "")
        )
        for kind, times in host.items():
            t, d = np.asarray(times), np.asarray(done[kind])
            line = f"  {kind:>24}: {len(t):>3} steps, host median {np.median(t):.3f} ms"
            line += f" (min {t.min():.3f}, max {t.max():.3f})"
            if cuda:
                line += f", with its device work {np.median(d):.3f} ms"
            print(line)
        if profiler is not None:
            pstats.Stats(profiler).sort_stats("cumulative").print_stats(args.profile)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {
        "demo": demo,
        "plan-bench": plan_bench,
        "bench": _bench,
        "info": info,
        "build": build,
    }
    if argv and argv[0] in ("-h", "--help"):
        print(
            "usage: prefixattn {demo,plan-bench,bench,info,build} [options]\n"
            "  demo        plan and run a shared-prefix batch (default when no command)\n"
            "  plan-bench  time plan construction on the host\n"
            "  bench       CUDA kernel benchmark against the HBM floor (GPU)\n"
            "  info        versions, GPU, compiled library and engine plugins\n"
            "  build       compile the library ahead of time into the cache"
        )
        return 0
    if not argv or argv[0].startswith("-"):
        return demo(argv)
    if argv[0] not in commands:
        print(
            f"prefixattn: unknown command {argv[0]!r}; try demo, plan-bench, bench, info or build",
            file=sys.stderr,
        )
        return 2
    return commands[argv[0]](argv[1:])


def info(argv: list[str]) -> int:
    """``prefixattn info``: what this environment can run."""
    from .runtime import info as runtime_info

    parser = argparse.ArgumentParser(prog="prefixattn info", description=info.__doc__)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    report = runtime_info.collect()
    print(json.dumps(report, indent=1) if args.json else runtime_info.render(report))
    return 0


def build(argv: list[str]) -> int:
    """``prefixattn build``: compile the library into the cache ahead of time."""
    from .runtime import compile as runtime_compile

    parser = argparse.ArgumentParser(
        prog="prefixattn build",
        description="Compile the native planner and the CUDA kernels for the installed torch "
        "into the cache that later processes load (default: for this machine's GPU, if any).",
    )
    parser.add_argument(
        "--cuda-archs",
        default=None,
        help="comma-separated CUDA architectures to compile the kernels for, without a GPU "
        f"(supported: {', '.join(runtime_compile.SUPPORTED_ARCHS)}); 'none': planner only",
    )
    parser.add_argument("--verbose", action="store_true", help="show the compiler's output")
    args = parser.parse_args(argv)
    if args.cuda_archs is None:
        spec = runtime_compile.default_spec()
    elif args.cuda_archs.strip().lower() == "none":
        spec = runtime_compile.BuildSpec()
    else:
        archs = tuple(a.strip() for a in args.cuda_archs.split(",") if a.strip())
        bad = [a for a in archs if a not in runtime_compile.SUPPORTED_ARCHS]
        if bad:
            parser.error(
                f"--cuda-archs {','.join(bad)}: not supported; the kernels are written for "
                + ", ".join(runtime_compile.SUPPORTED_ARCHS)
            )
        spec = runtime_compile.BuildSpec(archs)
    try:
        path = runtime_compile.ensure_built(spec, verbose=args.verbose)
    except runtime_compile.BuildError as e:
        print(e, file=sys.stderr)
        return 1
    print(path)
    return 0


def _bench(argv: list[str]) -> int:
    from . import bench

    return int(bench.main(argv) or 0)


if __name__ == "__main__":
    sys.exit(main())
