"""Decode step time from timed generations of two lengths.

A generation of ``n`` tokens takes ``a + n * step``: ``a`` (admission, prefill of the cached
prompts, teardown) varies from one generation to the next by more than a few decode steps, so
one difference ``(t(n2) - t(n1)) / (n2 - n1)`` is noisy. The benchmarks time ``n1`` and ``n2``
alternately, ``reps`` times, and report the median of the paired differences with their
spread, so that a reader sees how far two numbers must differ to mean something.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from typing import Any


def paired_step_ms(t1: list[float], t2: list[float], n1: int, n2: int) -> dict[str, float]:
    """Median, min and max over pairs of ``(t2[i] - t1[i]) / (n2 - n1)``, in ms.

    Worked example: t1 = [1.0, 1.2], t2 = [2.0, 2.1], n1 = 8, n2 = 40 -> pairs 31.25 and
    28.125 ms; median 29.688 (the mean of the two middle values), min 28.125, max 31.25.
    """
    if len(t1) != len(t2) or not t1:
        raise ValueError(f"need equal, non-empty lists of timings, got {len(t1)} and {len(t2)}")
    if n2 <= n1:
        raise ValueError(f"n2 ({n2}) must be larger than n1 ({n1})")
    steps = [(b - a) / (n2 - n1) * 1e3 for a, b in zip(t1, t2, strict=True)]
    return {
        "median": round(statistics.median(steps), 3),
        "min": round(min(steps), 3),
        "max": round(max(steps), 3),
    }


def inter_token_ms(outputs: Iterable[Any]) -> float | None:
    """The median over requests of their mean time between output tokens, in ms, from the
    engine's own timestamps (vLLM's ``RequestOutput.metrics``: ``first_token_ts``,
    ``last_token_ts``, ``num_generation_tokens``, kept when the engine logs stats): one
    generation's decode step without its admission and prefill. None where no request has
    the timestamps and at least two tokens.

    Worked example: requests of 5 tokens from 10.0 to 10.4 s and 3 tokens from 10.0 to
    10.3 s -> 100 and 150 ms; median 125.0.
    """
    steps = []
    for out in outputs:
        m = getattr(out, "metrics", None)
        n = getattr(m, "num_generation_tokens", 0) or 0
        first = getattr(m, "first_token_ts", None) or 0.0
        last = getattr(m, "last_token_ts", None) or 0.0
        if n >= 2 and last > first > 0:
            steps.append((last - first) / (n - 1) * 1e3)
    return round(statistics.median(steps), 3) if steps else None
