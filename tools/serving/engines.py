"""The serving benchmark's engine side: one backend of one engine, in this process.

Importing this module imports no engine; :class:`VllmDriver` and :class:`SglangDriver`
import theirs when built. The statistics the workers and the report share live here too.

Offline, a round's requests go to the engine at once (``LLM.generate`` /
``sgl.Engine.generate``; a ``lowload`` workload in chunks of its concurrency). Online,
requests arrive at Poisson times (``rate`` per second) or, for ``lowload``, as a closed loop
of ``concurrency`` clients, and stream through the engine's async API (vLLM ``AsyncLLM``,
``RequestOutputKind.DELTA``; SGLang ``Engine.async_generate(stream=True)``); every chunk's
arrival time gives the time to first token and the inter-token latencies, each sample of a
request (``n`` > 1) on its own (a chunk of k tokens counts as k gaps of a k-th of its wait
each).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import random
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tools.serving.workloads import Request, Workload, build, resolve_prompts
from tools.variants import parse_variant


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation between the closest ranks
    (numpy's default). Example: [1, 2, 3, 4], q = 50 -> 2.5; q = 99 -> 3.97."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def spread(values: Sequence[float], digits: int = 3) -> dict[str, float]:
    """Median, min and max of the repetitions."""
    if not values:
        raise ValueError("spread of no values")
    return {
        "median": round(statistics.median(values), digits),
        "min": round(min(values), digits),
        "max": round(max(values), digits),
    }


def run_metrics(
    wall_s: float,
    prompt_tokens: int,
    output_tokens: int,
    ttft_s: Sequence[float] = (),
    itl_s: Sequence[float] = (),
) -> dict[str, float]:
    """One repetition: throughputs, and the latency percentiles (ms) when streamed."""
    m = {
        "wall_s": round(wall_s, 4),
        "output_tok_s": round(output_tokens / wall_s, 2),
        "total_tok_s": round((prompt_tokens + output_tokens) / wall_s, 2),
        "output_tokens": output_tokens,
        "prompt_tokens": prompt_tokens,
    }
    for name, xs in (("ttft_ms", ttft_s), ("itl_ms", itl_s)):
        if xs:
            m[f"{name}_p50"] = round(percentile(xs, 50) * 1e3, 3)
            m[f"{name}_p99"] = round(percentile(xs, 99) * 1e3, 3)
    return m


def summarize_reps(reps: Sequence[dict[str, float]]) -> dict[str, Any]:
    """Median, min and max over repetitions of every metric they all carry."""
    keys = [k for k in reps[0] if all(k in r for r in reps)]
    out: dict[str, Any] = {k: spread([r[k] for r in reps]) for k in keys}
    out["reps"] = len(reps)
    return out


def arrival_times(count: int, rate: float, rng: random.Random) -> list[float]:
    """Poisson arrivals: cumulative exponential gaps of mean 1/rate seconds, the first at 0."""
    if rate <= 0:
        raise ValueError(f"rate must be positive, got {rate}")
    t, out = 0.0, []
    for _ in range(count):
        out.append(t)
        t += rng.expovariate(rate)
    return out


class Stream:
    """Arrival times of one request's streamed chunks, per sample (``index``): the samples of
    an ``n`` > 1 request interleave, and a gap between two samples' chunks is no token's
    latency."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.chunks: dict[int, list[tuple[float, int]]] = {}

    def tokens(self, k: int, index: int = 0) -> None:
        if k > 0:
            self.chunks.setdefault(index, []).append((time.perf_counter(), k))

    @property
    def output_tokens(self) -> int:
        return sum(k for chunks in self.chunks.values() for _, k in chunks)

    @property
    def ttft(self) -> float | None:
        firsts = [chunks[0][0] for chunks in self.chunks.values()]
        return min(firsts) - self.start if firsts else None

    def itl(self) -> list[float]:
        gaps = []
        for chunks in self.chunks.values():
            for (t0, _), (t1, k) in itertools.pairwise(chunks):
                gaps += [(t1 - t0) / k] * k
        return gaps


class Driver:
    """One engine with one attention backend; subclasses supply the engine calls."""

    loop: asyncio.AbstractEventLoop

    def generate(self, prompts: list[list[int]], reqs: Sequence[Request], temperature: float):
        """Offline: all at once; returns (output tokens, the first sample's ids per request)."""
        raise NotImplementedError

    async def stream(
        self,
        prompt: list[int],
        q: Request,
        temperature: float,
        on_tokens: Callable[[int, int], None],
    ) -> list[int]:
        """Online: one request; ``on_tokens(k, index)`` per chunk of k new tokens of sample
        ``index``; returns the first sample's ids."""
        raise NotImplementedError

    def start_profile(self, folder: Path, prefix: str, steps: int = 0) -> None:
        """Start the engine's torch profiler; its traces go below ``folder``. ``steps``: stop
        by itself after that many engine steps (0: at :meth:`stop_profile`)."""
        raise NotImplementedError

    def stop_profile(self) -> None:
        raise NotImplementedError

    def reset_cache(self) -> bool:
        raise NotImplementedError

    def info(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass

    def offline(self, w: Workload) -> dict[str, float]:
        prompts_prev: list[list[int]] = []
        outputs_prev: list[list[int]] = []
        prompt_tokens = output_tokens = 0
        t0 = time.perf_counter()
        for reqs in w.rounds:
            prompts = resolve_prompts(reqs, prompts_prev, outputs_prev)
            prompt_tokens += sum(len(p) * q.n for p, q in zip(prompts, reqs, strict=True))
            step = w.concurrency or len(reqs)
            outputs: list[list[int]] = []
            for i in range(0, len(reqs), step):
                n, ids = self.generate(prompts[i : i + step], reqs[i : i + step], w.temperature)
                output_tokens += n
                outputs += ids
            prompts_prev, outputs_prev = prompts, outputs
        return run_metrics(time.perf_counter() - t0, prompt_tokens, output_tokens)

    def online(self, w: Workload, rate: float, seed: int) -> dict[str, float]:
        return self.loop.run_until_complete(self._online(w, rate, seed))

    async def _online(self, w: Workload, rate: float, seed: int) -> dict[str, float]:
        rng = random.Random(seed)
        prompts_prev: list[list[int]] = []
        outputs_prev: list[list[int]] = []
        streams: list[Stream] = []
        prompt_tokens = 0
        t0 = time.perf_counter()
        for reqs in w.rounds:
            prompts = resolve_prompts(reqs, prompts_prev, outputs_prev)
            prompt_tokens += sum(len(p) * q.n for p, q in zip(prompts, reqs, strict=True))
            if w.concurrency:
                slots: asyncio.Semaphore | None = asyncio.Semaphore(w.concurrency)
                arrivals = [0.0] * len(reqs)
            else:
                slots, arrivals = None, arrival_times(len(reqs), rate, rng)
            start = time.perf_counter()
            outputs = await asyncio.gather(
                *(
                    self._one(p, q, w.temperature, start + a, slots, streams)
                    for p, q, a in zip(prompts, reqs, arrivals, strict=True)
                )
            )
            prompts_prev, outputs_prev = prompts, list(outputs)
        wall = time.perf_counter() - t0
        output_tokens = sum(s.output_tokens for s in streams)
        ttft = [t for s in streams if (t := s.ttft) is not None]
        itl = [g for s in streams for g in s.itl()]
        return run_metrics(wall, prompt_tokens, output_tokens, ttft, itl)

    async def _one(
        self,
        prompt: list[int],
        q: Request,
        temperature: float,
        arrival: float,
        slots: asyncio.Semaphore | None,
        streams: list[Stream],
    ) -> list[int]:
        """One online request: it arrives at ``arrival`` (perf_counter time) or, in a closed
        loop, when one of ``slots`` frees; its clock starts then."""
        delay = arrival - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        async with slots if slots is not None else contextlib.nullcontext():
            s = Stream(time.perf_counter())
            streams.append(s)
            return await self.stream(prompt, q, temperature, s.tokens)


class VllmDriver(Driver):
    """vLLM: ``LLM`` offline (engine core in this process when the parent sets
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), ``AsyncLLM`` online (engine core forked)."""

    def __init__(self, backend: str, args: Any) -> None:
        base, changes = parse_variant(backend, ours="prefixattn")
        attention = {"prefixattn": "CUSTOM", "bound": "NOATTN", "readfloor": "KVFLOOR"}.get(
            base, base
        )
        if backend == "bound":
            from tools.vllm.noattn import register

            register()
        elif backend == "readfloor":
            from tools.vllm.noattn import register_kv_floor

            register_kv_floor()
        kwargs: dict[str, Any] = dict(
            model=args.model, load_format="dummy", skip_tokenizer_init=True,
            attention_backend=attention, gpu_memory_utilization=args.gpu_mem,
            max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
            enable_prefix_caching=True, seed=0,
        )  # fmt: skip
        if changes:
            kwargs["additional_config"] = {"prefixattn": changes}
        if getattr(args, "profile", None) is not None:  # traces of this backend's runs
            kwargs["profiler_config"] = {
                "profiler": "torch", "ignore_frontend": True, "torch_profiler_with_stack": False,
                "torch_profiler_dir": str(Path(args.profile) / backend),
                "torch_profiler_dump_cuda_time_total": False,
            }  # fmt: skip
        if args.capture_sizes != "default":
            sizes = [int(x) for x in args.capture_sizes.split(",")]
            kwargs["compilation_config"] = {"cudagraph_capture_sizes": sizes}
        self.loop = asyncio.new_event_loop()
        self.ids = itertools.count()
        self.online_mode = args.mode == "online"
        if self.online_mode:
            import torch

            if backend in ("bound", "readfloor") and torch.cuda.is_initialized():
                raise RuntimeError(
                    "CUDA is initialized in the benchmark process, so vLLM would spawn the "
                    f"engine core, where {attention} is not registered"
                )
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM

            async def start() -> Any:  # inside the loop, so its output handler runs there
                return AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))

            self.engine = self.loop.run_until_complete(start())
        else:
            from vllm import LLM

            self.llm = LLM(**kwargs)

    def _params(self, q: Request, temperature: float, delta: bool = False) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        extra = {"output_kind": RequestOutputKind.DELTA} if delta else {}
        return SamplingParams(n=q.n, temperature=temperature, max_tokens=q.max_tokens,
                              ignore_eos=True, detokenize=False, **extra)  # fmt: skip

    def generate(self, prompts, reqs, temperature):
        from vllm import TokensPrompt

        outs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts],
            [self._params(q, temperature) for q in reqs],
            use_tqdm=False,
        )
        tokens = sum(len(o.token_ids) for r in outs for o in r.outputs)
        return tokens, [list(r.outputs[0].token_ids) for r in outs]

    async def stream(self, prompt, q, temperature, on_tokens):
        from vllm import TokensPrompt

        ids: list[int] = []
        sp = self._params(q, temperature, delta=True)
        gen = self.engine.generate(TokensPrompt(prompt_token_ids=prompt), sp, f"r{next(self.ids)}")
        async for out in gen:
            for o in out.outputs:
                on_tokens(len(o.token_ids), o.index)
            ids += [t for o in out.outputs if o.index == 0 for t in o.token_ids]
        return ids

    def start_profile(self, folder: Path, prefix: str, steps: int = 0) -> None:
        # The folder was fixed when the engine started (profiler_config); the prefix names
        # this trace.
        if self.online_mode:  # AsyncLLM (vLLM 0.33: max_iterations per profile)
            limit = {"max_iterations": steps} if steps else {}
            self.loop.run_until_complete(self.engine.start_profile(prefix, **limit))
            return
        if steps:
            try:
                self.llm.start_profile(prefix, max_iterations=steps)
                return
            except TypeError:  # vLLM before 0.33: no per-session limit, the whole run
                pass
        self.llm.start_profile(prefix)

    def stop_profile(self) -> None:
        # Nothing to stop after max_iterations: vLLM checks.
        if self.online_mode:
            self.loop.run_until_complete(self.engine.stop_profile())
        else:
            self.llm.stop_profile()

    def reset_cache(self) -> bool:
        if self.online_mode:
            return bool(self.loop.run_until_complete(self.engine.reset_prefix_cache()))
        return bool(self.llm.reset_prefix_cache())

    def info(self) -> dict[str, Any]:
        cfg = self.engine.vllm_config if self.online_mode else self.llm.llm_engine.vllm_config
        return {
            "cudagraph_mode": str(cfg.compilation_config.cudagraph_mode),
            "attention_backend": str(cfg.attention_config.backend),
            "block_size": cfg.cache_config.block_size,
            "num_gpu_blocks": cfg.cache_config.num_gpu_blocks,
        }

    def close(self) -> None:
        if self.online_mode:
            self.engine.shutdown()


class SglangDriver(Driver):
    """SGLang: ``sgl.Engine`` (scheduler spawned); offline ``generate``, online
    ``async_generate(stream=True)`` on the engine's own event loop."""

    def __init__(self, backend: str, args: Any) -> None:
        base, _ = parse_variant(backend)  # the scheduler's options come from its plugin
        attention = {"bound": "noattn", "readfloor": "kvfloor"}.get(base, base)
        if backend == "bound":
            from tools.sglang.noattn import register

            register()  # this process; the scheduler's comes from the plugin entry point
        elif backend == "readfloor":
            from tools.sglang.noattn import register_kv_floor

            register_kv_floor()
        import sglang as sgl

        self.engine = sgl.Engine(
            model_path=args.model, load_format="dummy", skip_tokenizer_init=True,
            attention_backend=attention, mem_fraction_static=args.gpu_mem,
            context_length=args.max_model_len, max_running_requests=args.max_num_seqs,
            random_seed=0, log_level="warning",
        )  # fmt: skip
        self.loop = self.engine.loop

    @staticmethod
    def _params(q: Request, temperature: float) -> dict[str, Any]:
        return {"n": q.n, "temperature": temperature, "max_new_tokens": q.max_tokens,
                "ignore_eos": True}  # fmt: skip

    def generate(self, prompts, reqs, temperature):
        n = reqs[0].n
        if any(q.n != n for q in reqs):  # SGLang takes one n per batch
            raise ValueError("an SGLang batch needs the same n in every request")
        outs = self.engine.generate(
            input_ids=prompts, sampling_params=[self._params(q, temperature) for q in reqs]
        )
        tokens = sum(int(o["meta_info"]["completion_tokens"]) for o in outs)
        return tokens, [list(outs[i * n]["output_ids"]) for i in range(len(reqs))]

    async def stream(self, prompt, q, temperature, on_tokens):
        done: dict[int, int] = {}
        ids: list[int] = []
        gen = await self.engine.async_generate(
            input_ids=prompt, sampling_params=self._params(q, temperature), stream=True
        )
        async for chunk in gen:
            index = int(chunk.get("index", 0))
            count = int(chunk["meta_info"]["completion_tokens"])  # cumulative
            on_tokens(count - done.get(index, 0), index)
            done[index] = count
            if index == 0:  # cumulative (the last chunk's is a copy): no copy per chunk
                ids = chunk["output_ids"]
        return list(ids)

    def start_profile(self, folder: Path, prefix: str, steps: int = 0) -> None:
        self.engine.start_profile(output_dir=str(folder), activities=["CPU", "GPU"],
                                  with_stack=False, profile_prefix=prefix,
                                  num_steps=steps or None)  # fmt: skip
        self.profile_steps = steps

    def stop_profile(self) -> None:
        try:
            self.engine.stop_profile()
        except RuntimeError as e:  # a profile of num_steps stops by itself
            if not (getattr(self, "profile_steps", 0) and "not in progress" in str(e)):
                raise

    def reset_cache(self) -> bool:
        out = self.engine.flush_cache()
        return bool(getattr(out, "success", out))

    def info(self) -> dict[str, Any]:
        s = self.engine.get_server_info()
        keys = ("attention_backend", "max_total_num_tokens", "cuda_graph_max_bs",
                "disable_cuda_graph", "page_size", "max_running_requests")  # fmt: skip
        return {k: s.get(k) for k in keys}

    def close(self) -> None:
        self.engine.shutdown()


def measure(
    driver: Driver,
    w: Workload,
    args: Any,
    progress: Callable[[dict[str, Any]], object] = lambda summary: None,
) -> dict[str, Any]:
    """One warm-up run (not timed), then ``args.reps`` timed runs, each after a prefix-cache
    reset; their median, min and max, and each run's metrics. ``progress(summary)`` after
    every timed run but the last: the summary so far, marked ``partial``."""
    runs = []
    resets = []
    for rep in range(args.reps + 1):
        resets.append(driver.reset_cache())
        if args.mode == "online":
            run = driver.online(w, args.rate, args.seed * 1000 + rep)
        else:
            run = driver.offline(w)
        print(f"  {w.name} {'warm-up' if rep == 0 else f'rep {rep}'}: {run}", flush=True)
        if rep:
            runs.append(run)
            summary = {**summarize_reps(runs), "runs": runs, "cache_resets_ok": all(resets)}
            if rep < args.reps:
                progress({**summary, "partial": True})
    return summary


def profile_run(
    driver: Driver,
    w: Workload,
    folder: Path,
    steps: int = 0,
    online: tuple[float, int] | None = None,
) -> None:
    """One more run of ``w`` after a prefix-cache reset, under the engine's profiler (traces
    below ``folder``, named after the workload; its first ``steps`` engine steps, 0: all):
    offline, or with ``online`` = (rate, seed) an online run at that rate; the profiler
    stops on any error."""
    driver.reset_cache()
    driver.start_profile(folder, w.name, steps)
    try:
        if online is None:
            driver.offline(w)
        else:
            driver.online(w, *online)
    finally:
        driver.stop_profile()


def run_worker(args: Any, save: Callable[[dict[str, Any]], object]) -> None:
    """The worker of ``tools.serving.bench``: start the engine with ``args.worker`` and
    measure every workload, calling ``save(result)`` after each (and after each of its timed
    runs but the last, with what it has so far)."""
    from tools.serving.workloads import parse_sizes

    sizes = parse_sizes(args.size)
    t0 = time.perf_counter()
    cls = VllmDriver if args.engine == "vllm" else SglangDriver
    driver = cls(args.worker, args)
    result: dict[str, Any] = {"engine_start_s": round(time.perf_counter() - t0, 1),
                              "workloads": {}}  # fmt: skip
    try:
        result["info"] = driver.info()
    except Exception as e:  # report, never fail the run here
        result["info"] = {"error": f"{type(e).__name__}: {e}"}
    save(result)
    try:
        for name in args.workloads:
            for w in build(name, sizes, args.seed):
                print(f"{args.worker}: {w.name} {w.describe()}", flush=True)

                def progress(summary: dict[str, Any], key: str = w.name) -> None:
                    result["workloads"][key] = summary  # kept if the worker is cut off
                    save(result)

                result["workloads"][w.name] = measure(driver, w, args, progress)
                save(result)
                if getattr(args, "profile", None) is not None:  # never in the timings above
                    steps = getattr(args, "profile_steps", 0)
                    # Online: the arrivals of one more seed than the timed runs had.
                    online = (args.rate, args.seed * 1000 + args.reps + 1)
                    profile_run(driver, w, Path(args.profile) / args.worker, steps,
                                online if args.mode == "online" else None)  # fmt: skip
        result["finished"] = True
        save(result)
    finally:
        driver.close()
