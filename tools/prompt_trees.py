"""Prompt sets shared by the engine checks and the integration matrix."""

from __future__ import annotations

import random


def two_level_tree(rng: random.Random, vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    """Multi-level shared prefixes: 2 roots of 700 tokens, 3 children of 300 under each root,
    4 requests under each child with private tails of 1-90 tokens. Returns (the 6 children's
    prompts, to put in the prefix cache first; the 24 requests)."""

    def toks(n: int) -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(n)]

    warm: list[list[int]] = []
    prompts: list[list[int]] = []
    for _ in range(2):
        root = toks(700)
        for _ in range(3):
            child = root + toks(300)
            warm.append(child)
            prompts += [child + toks(rng.randint(1, 90)) for _ in range(4)]
    return warm, prompts
