"""How often a hinted step falls back to the per-request plan, on a model of an engine's rows.

A hinted plan takes each request's sharing from an earlier step's copy of the block table
(``StepPlanner``, ``prefixattn.engine.step``); where a request is matched to a row that
describes another request, the device check fails and the whole step runs the per-request
fallback. This drives a ``StepPlanner`` on the CPU with the decode steps of forest-like
traffic: ``--requests`` running requests under 16 shared prefixes (4 system prompts of 1536
tokens, 4 templates of 512 under each), user context of 64-320 tokens, outputs of 16-256
tokens; a request that finishes leaves and a new one (its prompt prefilled, so some tokens
on) joins. Rows move as the engine moves them:

- ``sglang``: the gaps close in order, new requests come last;
- ``vllm``: the model runner's order (the same), with its request-state indices as ids;
- ``vllm-v1``: the older runner's, the last rows moved into the gaps, new requests last.

With ``--extend`` (SGLang's steps), the new requests of a step are first prefilled in a
step of their own (their user tokens; the shared prefix is cached), as SGLang runs extend
batches apart from decode batches. With ``--mixed`` (vLLM's steps), they are prefilled in
the step they join, after the decodes, as vLLM runs mixed prefill and decode steps.
With ``--lag K`` the planner's looks (the sharing probe's verdict, the hint's copy) land K
steps after they start: 1 (the default) by the next step's planning, as when the host plans a
step while the GPU runs the one before; 2 or more as when the host runs further ahead. A look
started while the previous one is on its way is skipped, as the real copies are.

It prints the plan kinds of the decode (or mixed) steps (``hinted-fallback``: the check
failed; ``unshared``: planned without the sharing), those of the extend steps, and the
planner's counts (``host_ms_per_plan``: the mean host time of a planning call by kind, on
this machine's one core). With ``--parts``, also the host time of the plans each planning
call builds (``plan_ms``, per packing: ``memory`` the prefix-aware plan, ``per_query`` the
per-request one, a hinted plan's fallback among them; calls and mean ms). On the CPU the
device's work (gathering page ids, the hint's check) runs on the host too.

    python benchmarks/hint_fallbacks.py --order sglang --steps 120 --extend
    python benchmarks/hint_fallbacks.py --order vllm --page-size 16 --mixed
    python benchmarks/hint_fallbacks.py --order vllm --page-size 16 --mixed --lag 2
    python benchmarks/hint_fallbacks.py --order vllm --page-size 16 --mixed --steps 240 --parts
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from prefixattn import PrefixAttention
from prefixattn.engine.step import StepPlanner


class Requests:
    """The running requests of the model: pages, length, tokens left, id."""

    def __init__(self, rng: np.random.Generator, page_size: int) -> None:
        self.rng = rng
        self.ps = page_size
        self.next_page = 0
        self.next_id = 0
        self.prefixes: list[list[int]] = []
        for _ in range(4):
            system = self._pages(1536)
            for _ in range(4):
                self.prefixes.append(system + self._pages(512))

    def _pages(self, tokens: int) -> list[int]:
        n = -(-tokens // self.ps)
        out = list(range(self.next_page, self.next_page + n))
        self.next_page += n
        return out

    def new(self) -> list[Any]:
        """[pages, length, tokens left, id, prompt tokens not cached]"""
        prefix = self.prefixes[int(self.rng.integers(0, len(self.prefixes)))]
        user = int(self.rng.integers(64, 321))
        out = int(self.rng.integers(16, 257))
        pages = prefix + self._pages(user + out + self.ps)
        self.next_id += 1
        return [pages, len(prefix) * self.ps + user, out, self.next_id, user]


class LaggedLooks:
    """The probe's and the hint's looks of ``planner`` landing ``lag`` steps after they
    start (:meth:`tick` at each step lands those due); counts the looks started."""

    def __init__(self, planner: StepPlanner, lag: int) -> None:
        self.lag, self.now = lag, 0
        self.pending: dict[str, tuple[int, tuple[Any, ...]]] = {}
        self.started = {"probe": 0, "hint": 0}
        probe, hint = planner.probe, planner.table_hint
        self.land: dict[str, Callable[..., None]] = {
            "probe": probe.observe, "hint": hint.observe,
        }  # fmt: skip
        probe.start = functools.partial(self._start, "probe")  # type: ignore[method-assign]
        hint.start = functools.partial(self._start, "hint")  # type: ignore[method-assign]
        probe.in_flight = functools.partial(self._in_flight, "probe")  # type: ignore[method-assign]
        hint.in_flight = functools.partial(self._in_flight, "hint")  # type: ignore[method-assign]

    def _in_flight(self, name: str) -> bool:
        return name in self.pending

    def _start(self, name: str, *args: Any) -> bool:
        if name in self.pending:
            return False
        self.started[name] += 1
        data: tuple[Any, ...]
        if name == "probe":
            first, real = (*args, None)[:2]
            pages = first if real is None else first[real]
            data = (pages.numpy().copy(),)
        else:
            table, lens, page_size = args[:3]
            ids = args[3] if len(args) > 3 else None
            data = (table.numpy().copy(), np.array(lens), page_size, ids)
        self.pending[name] = (self.now + self.lag, data)
        self.tick(self.now)  # lag 0: lands at once
        return True

    def tick(self, now: int) -> None:
        self.now = now
        for name, (due, data) in list(self.pending.items()):
            if due <= now:
                del self.pending[name]
                self.land[name](*data)


def _table(rows: list[list[Any]], page_size: int) -> tuple[np.ndarray, np.ndarray]:
    lens = np.array([r[1] for r in rows], np.int32)
    width = int(-(-lens.max() // page_size)) + 1
    table = np.zeros((len(rows), width), np.int32)
    for i, r in enumerate(rows):
        n = -(-r[1] // page_size)
        table[i, :n] = r[0][:n]
    return table, lens


def _step(
    planner: StepPlanner,
    rows: list[list[Any]],
    page_size: int,
    qo_indptr: np.ndarray | None,
    extra: dict[str, Any],
) -> str:
    """Plan one step of ``rows`` (decode when ``qo_indptr`` is None; else with those query
    tokens per row: the new requests' prefills alone, as SGLang's extend batches, with
    ``prefill_only`` in ``extra``, or vLLM's mixed steps); its plan kind."""
    table, lens = _table(rows, page_size)
    decode = qo_indptr is None or int(np.diff(qo_indptr).max()) <= 1
    choice = planner.choose(len(rows), decode=decode)
    attention = planner.attention_for(graph=False)
    if choice.device_table:
        plan = planner.plan_device(
            attention, choice, torch.from_numpy(table), lens, qo_indptr, num_real=len(rows),
            **extra,
        )  # fmt: skip
    else:
        plan = planner.plan_host(attention, table, lens, qo_indptr, num_real=len(rows), **extra)
    kind: str = choice.kind
    if plan.fallback_taken is not None and bool(plan.fallback_taken):
        kind += "-fallback"
    return kind


@contextlib.contextmanager
def plan_parts(totals: dict[str, list[float]]) -> Any:
    """Time every plan a planning call builds (``PrefixAttention._plan_host``), by packing:
    ``totals[packing]`` = [calls, seconds]."""
    build = PrefixAttention._plan_host

    def timed(self: PrefixAttention, table: Any, lens: Any, indptr: Any, packing: str,
              *args: Any, **kwargs: Any) -> Any:  # fmt: skip
        t0 = time.perf_counter()
        try:
            return build(self, table, lens, indptr, packing, *args, **kwargs)
        finally:
            entry = totals.setdefault(packing, [0, 0.0])
            entry[0] += 1
            entry[1] += time.perf_counter() - t0

    PrefixAttention._plan_host = timed  # type: ignore[method-assign]
    try:
        yield
    finally:
        PrefixAttention._plan_host = build  # type: ignore[method-assign]


def run(
    order: str,
    steps: int,
    requests: int,
    page_size: int,
    seed: int,
    extend: bool = False,
    mixed: bool = False,
    lag: int = 1,
    parts: bool = False,
) -> dict[str, Any]:
    totals: dict[str, list[float]] = {}
    with plan_parts(totals) if parts else contextlib.nullcontext():
        out = _run(order, steps, requests, page_size, seed, extend, mixed, lag)
    if parts:
        out["plan_ms"] = {k: {"calls": int(n), "mean_ms": round(1e3 * t / n, 3)}
                          for k, (n, t) in sorted(totals.items())}  # fmt: skip
    return out


def _run(
    order: str,
    steps: int,
    requests: int,
    page_size: int,
    seed: int,
    extend: bool,
    mixed: bool,
    lag: int,
) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    model = Requests(rng, page_size)
    planner = StepPlanner(
        lambda: PrefixAttention(32, 8, 128, page_size, device="cpu", dtype=torch.bfloat16),
        page_size,
    )
    looks = LaggedLooks(planner, lag)
    rows = [model.new() for _ in range(requests)]
    kinds: dict[str, int] = {}
    extend_kinds: dict[str, int] = {}
    for now in range(steps):
        looks.tick(now)
        if order == "vllm-v1":
            for i in reversed([i for i, r in enumerate(rows) if r[2] <= 0]):
                last = rows.pop()
                if i < len(rows):
                    rows[i] = last
        else:
            rows = [r for r in rows if r[2] > 0]
        new: list[list[Any]] = []
        while len(rows) + len(new) < requests:
            new.append(model.new())
        if extend and new:
            # The new requests' prefill, apart: their user tokens on the cached prefix.
            starts = np.concatenate([[0], np.cumsum([r[4] for r in new])]).astype(np.int32)
            kind = _step(planner, new, page_size, starts, {"prefill_only": True})
            extend_kinds[kind] = extend_kinds.get(kind, 0) + 1
        decoding = len(rows)
        rows += new
        for r in rows[:decoding] if mixed else rows:
            r[1] += 1
            r[2] -= 1
        # Request ids only where the engine gives them (and so a build without them runs too).
        extra: dict[str, Any] = {"ids": np.array([r[3] for r in rows])} if order == "vllm" else {}
        indptr: np.ndarray | None = None
        if mixed and new:  # the decodes' one token each, then the new requests' prompts
            q = [1] * decoding + [r[4] for r in new]
            indptr = np.concatenate([[0], np.cumsum(q)]).astype(np.int32)
        kind = _step(planner, rows, page_size, indptr, extra)
        if mixed:  # the prompt's last token was the new requests' first output
            for r in new:
                r[2] -= 1
        kinds[kind] = kinds.get(kind, 0) + 1
    out = {"order": order, "steps": steps, "lag": lag, "kinds": kinds,
           "looks_started": dict(looks.started), "counts": planner.counts()}  # fmt: skip
    if extend:
        out["extend_kinds"] = extend_kinds
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--order", choices=("sglang", "vllm", "vllm-v1"), default="sglang")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--page-size", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--extend", action="store_true",
                    help="prefill new requests in steps of their own first (SGLang)")  # fmt: skip
    ap.add_argument("--mixed", action="store_true",
                    help="prefill new requests in the step they join, after the decodes "
                         "(vLLM)")  # fmt: skip
    ap.add_argument("--parts", action="store_true",
                    help="also time the plans each planning call builds, by packing")  # fmt: skip
    ap.add_argument("--lag", type=int, default=1,
                    help="steps after which a look's copy lands (1: by the next step's "
                         "planning; more: the host that far ahead of the GPU)")  # fmt: skip
    args = ap.parse_args()
    if args.extend and args.mixed:
        ap.error("--extend and --mixed are two engines' ways to prefill: choose one")
    if args.steps < 1 or args.requests < 1 or not 1 <= args.page_size <= 128:
        ap.error("--steps and --requests must be positive, --page-size in 1..128")
    if args.lag < 0:
        ap.error("--lag must be 0 or more")
    out = run(
        args.order, args.steps, args.requests, args.page_size, args.seed, args.extend,
        args.mixed, args.lag, args.parts,
    )  # fmt: skip
    print(json.dumps(out))


if __name__ == "__main__":
    main()
