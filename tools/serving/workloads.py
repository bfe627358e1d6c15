"""Serving workloads: token-id prompt sets with the sharing structure of real traffic.

Pure Python and deterministic from a seed; token ids are drawn from ``[10, vocab)``. Each
workload is a list of rounds of requests; a round is submitted once the previous one finished
(only ``multiturn`` has more than one). Sizes come from :data:`DEFAULT_SIZES`, overridden per
key (``--size forest.requests=320``).

- ``forest``: ``systems`` system prompts, ``templates`` templates under each, per-user context
  of ``user_min``-``user_max`` tokens; outputs of ``out_min``-``out_max`` tokens; ``requests``
  (more than the batch holds, so prefills keep entering), interleaved over the templates.
- ``multiturn``: ``conversations`` under one system prompt; turn k+1's prompt is turn k's
  prompt, turn k's generated tokens and a new user message (:func:`resolve_prompts`); round k
  submits turn k of every conversation.
- ``parallel``: ``prompts`` prompts (a shared system prompt, then a private question), each
  sampled ``n`` times (the engine's parallel sampling), temperature 1.
- ``longprompt``: long private prompts, short outputs.
- ``chat``: private prompts and outputs of varied length, nothing shared.
- ``decode``: one shared prefix, private tails, long fixed outputs (decode-dominated).
- ``lowload``: a shared system prompt and private questions, at most 1, 4 or 16 requests in
  flight (one workload per concurrency, ``lowload-c1`` ...).
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections.abc import Sequence
from typing import Any

WORKLOADS = ("forest", "multiturn", "parallel", "longprompt", "chat", "decode", "lowload")
VOCAB = 128256
MIN_TOKEN = 10

DEFAULT_SIZES: dict[str, dict[str, Any]] = {
    "forest": {"systems": 4, "system_len": 1536, "templates": 4, "template_len": 512,
               "user_min": 64, "user_max": 320, "out_min": 16, "out_max": 256,
               "requests": 640},
    "multiturn": {"conversations": 64, "system_len": 1024, "first_min": 256, "first_max": 768,
                  "turns": 4, "user_min": 32, "user_max": 128, "out_min": 64, "out_max": 192},
    "parallel": {"prompts": 32, "system_len": 512, "question_len": 512, "n": 8, "out": 128},
    "longprompt": {"requests": 64, "prompt_len": 6144, "out": 16},
    "chat": {"requests": 384, "prompt_min": 256, "prompt_max": 1024, "out_min": 64,
             "out_max": 256},
    "decode": {"requests": 256, "prefix": 4096, "tail": 64, "out": 256},
    "lowload": {"concurrency": [1, 4, 16], "per_slot": 4, "system_len": 1024,
                "question_len": 256, "out": 128},
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Request:
    """One request. ``prompt`` is the whole prompt, or, when ``follows`` is set, the new
    user message appended to request ``follows`` of the previous round (its prompt, then its
    generated tokens)."""

    prompt: tuple[int, ...]
    max_tokens: int
    n: int = 1
    follows: int | None = None
    tag: str = ""
    """Where the request sits in its workload's structure, e.g. ``s2/t1`` (forest)."""


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    rounds: tuple[tuple[Request, ...], ...]
    concurrency: int = 0
    """At most this many requests in flight (closed loop); 0: all at once (offline) or
    Poisson arrivals (online)."""
    temperature: float = 0.0

    @property
    def num_requests(self) -> int:
        return sum(len(r) for r in self.rounds)

    @property
    def output_tokens(self) -> int:
        """Tokens the workload generates (outputs ignore EOS, so this is exact)."""
        return sum(q.max_tokens * q.n for r in self.rounds for q in r)

    def describe(self) -> dict[str, Any]:
        first = self.rounds[0]
        return {
            "rounds": len(self.rounds), "requests": self.num_requests,
            "samples": sum(q.n for r in self.rounds for q in r),
            "first_round_prompt_tokens": sum(len(q.prompt) for q in first),
            "first_round_distinct_tokens": distinct_tokens([q.prompt for q in first]),
            "output_tokens": self.output_tokens, "concurrency": self.concurrency,
            "temperature": self.temperature,
        }  # fmt: skip


def distinct_tokens(prompts: Sequence[Sequence[int]]) -> int:
    """Tokens a prefix cache holds for these prompts (every shared prefix once): the sum of
    lengths minus each prompt's longest common prefix with its predecessor in sorted order.

    Example: [1, 2, 3], [1, 2, 4], [5] -> 7 - 2 = 5 (the trie 1-2-3, 4 under 1-2, and 5).
    """
    ps = sorted(tuple(p) for p in prompts)
    total = sum(len(p) for p in ps)
    for a, b in itertools.pairwise(ps):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        total -= n
    return total


def resolve_prompts(
    requests: Sequence[Request],
    prev_prompts: Sequence[Sequence[int]] = (),
    prev_outputs: Sequence[Sequence[int]] = (),
) -> list[list[int]]:
    """The token ids to submit for one round: a follow-up request's prompt is the previous
    round's prompt and output of the request it follows, then its own message.

    Example: prev_prompts = [[5, 6]], prev_outputs = [[7]], Request(prompt=(8, 9), follows=0)
    -> [5, 6, 7, 8, 9].
    """
    out = []
    for q in requests:
        if q.follows is None:
            out.append(list(q.prompt))
        else:
            out.append([*prev_prompts[q.follows], *prev_outputs[q.follows], *q.prompt])
    return out


def expand_names(names: Sequence[str], sizes: dict[str, dict[str, Any]]) -> list[str]:
    """Workload names as reported: ``lowload`` becomes one name per concurrency."""
    out = []
    for name in names:
        if name == "lowload":
            out += [f"lowload-c{c}" for c in sizes["lowload"]["concurrency"]]
        else:
            out.append(name)
    return out


def parse_sizes(overrides: Sequence[str]) -> dict[str, dict[str, Any]]:
    """:data:`DEFAULT_SIZES` with ``WORKLOAD.KEY=VALUE`` overrides (integers; a list of
    integers as ``1,4,16``). Raises ``ValueError`` naming the bad item."""
    sizes = {w: dict(v) for w, v in DEFAULT_SIZES.items()}
    for item in overrides:
        key, sep, value = item.partition("=")
        workload, dot, field = key.partition(".")
        if not sep or not dot or workload not in sizes or field not in sizes[workload]:
            known = ", ".join(f"{w}.{k}" for w, d in DEFAULT_SIZES.items() for k in d)
            raise ValueError(f"bad size {item!r}: expected WORKLOAD.KEY=VALUE, one of {known}")
        try:
            parsed = [int(x) for x in value.split(",")]
        except ValueError:
            raise ValueError(f"bad size {item!r}: {value!r} is not an integer") from None
        if isinstance(sizes[workload][field], list):
            sizes[workload][field] = parsed
        elif len(parsed) == 1:
            sizes[workload][field] = parsed[0]
        else:
            raise ValueError(f"bad size {item!r}: {field} takes one integer")
    return sizes


class _Tokens:
    def __init__(self, seed: int, vocab: int) -> None:
        self.rng = random.Random(seed)
        self.vocab = vocab

    def __call__(self, n: int) -> tuple[int, ...]:
        return tuple(self.rng.randrange(MIN_TOKEN, self.vocab) for _ in range(n))

    def between(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)


def build(
    name: str, sizes: dict[str, dict[str, Any]] | None = None, seed: int = 0, vocab: int = VOCAB
) -> list[Workload]:
    """The workload ``name`` (``lowload``: one per concurrency), the same for the same seed."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    s = (sizes or DEFAULT_SIZES)[name]
    toks = _Tokens(seed * 1000 + WORKLOADS.index(name), vocab)
    if name == "forest":
        systems = [toks(s["system_len"]) for _ in range(s["systems"])]
        templates = [
            [sp + toks(s["template_len"]) for _ in range(s["templates"])] for sp in systems
        ]
        reqs = []
        for i in range(s["requests"]):
            si, ti = i % s["systems"], (i // s["systems"]) % s["templates"]
            user = toks(toks.between(s["user_min"], s["user_max"]))
            out = toks.between(s["out_min"], s["out_max"])
            reqs.append(Request(templates[si][ti] + user, out, tag=f"s{si}/t{ti}"))
        toks.rng.shuffle(reqs)
        return [Workload(name, (tuple(reqs),))]
    if name == "multiturn":
        system = toks(s["system_len"])
        rounds = [
            tuple(
                Request(system + toks(toks.between(s["first_min"], s["first_max"])),
                        toks.between(s["out_min"], s["out_max"]), tag=f"c{c}")
                for c in range(s["conversations"])
            )
        ]  # fmt: skip
        for _ in range(1, s["turns"]):
            rounds.append(
                tuple(
                    Request(toks(toks.between(s["user_min"], s["user_max"])),
                            toks.between(s["out_min"], s["out_max"]), follows=c, tag=f"c{c}")
                    for c in range(s["conversations"])
                )
            )  # fmt: skip
        return [Workload(name, tuple(rounds))]
    if name == "parallel":
        system = toks(s["system_len"])
        reqs = [
            Request(system + toks(s["question_len"]), s["out"], n=s["n"], tag=f"p{i}")
            for i in range(s["prompts"])
        ]
        return [Workload(name, (tuple(reqs),), temperature=1.0)]
    if name == "longprompt":
        reqs = [Request(toks(s["prompt_len"]), s["out"]) for _ in range(s["requests"])]
        return [Workload(name, (tuple(reqs),))]
    if name == "chat":
        reqs = [
            Request(toks(toks.between(s["prompt_min"], s["prompt_max"])),
                    toks.between(s["out_min"], s["out_max"]))
            for _ in range(s["requests"])
        ]  # fmt: skip
        return [Workload(name, (tuple(reqs),))]
    if name == "decode":
        prefix = toks(s["prefix"])
        reqs = [Request(prefix + toks(s["tail"]), s["out"]) for _ in range(s["requests"])]
        return [Workload(name, (tuple(reqs),))]
    # lowload
    system = toks(s["system_len"])
    loads = []
    for c in s["concurrency"]:
        reqs = [
            Request(system + toks(s["question_len"]), s["out"]) for _ in range(c * s["per_slot"])
        ]
        loads.append(Workload(f"lowload-c{c}", (tuple(reqs),), concurrency=c))
    return loads
