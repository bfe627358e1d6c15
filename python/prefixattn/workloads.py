"""Shared-prefix batches in the PAT paper's tree notation, as paged block tables.

``"1,4,64_1024,256,128"``: node counts per level, then tokens per node per level. One root of
1024 tokens, 4 children of 256 (fan-out 4), 64 leaves of 128 (fan-out 16): 64 requests, each
with 1024 + 256 + 128 tokens. The last level's count is the batch size. Fan-out is uniform.

Pages are assigned the way a prefix-caching engine does: a full page whose tokens all lie in
nodes shared by several requests is stored once; a page that reaches into a node of its own
(or a request's partially filled last page) is private. Page ids are shuffled so that shared
pages are not adjacent in memory.
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import numpy as np

PAT_TREES = (
    "1,10_4096,416",
    "1,256_256,32",
    "1,1024_2048,32",
    "1,2,64_1024,256,256",
    "1,4,256_32,256,32",
    "1,8,512_32,512,256",
    "1,8,512_32,2048,256",
    "1,8,512_512,512,256",
    "1,4,8,256_32,256,256,32",
    "1,4,16,512_1024,256,128,32",
    "1,4,16,64,256,1024_256,32,256,64,32,256",
    "1,16,32,64,128,1024_256,128,64,32,32,32",
    "1,16,32,64,256,1024_256,128,64,32,32,32",
    "1,8,16,32,64,128,1024_256,128,64,32,32,32,32",
    "1,8,16,32,64,256,1024_256,128,64,32,32,32,32",
    "2,8,16,256_256,256,32,32",
    "4,16,256,512_512,32,128,32",
    "8,16,32,256_512,512,256,32",
    "256_1024",
    "256_4096",
)
"""The kernel-evaluation suite of the PAT paper (Figure 10)."""


@dataclasses.dataclass(frozen=True)
class TreeSpec:
    counts: tuple[int, ...]
    tokens: tuple[int, ...]

    @property
    def batch_size(self) -> int:
        return self.counts[-1]

    @property
    def seq_len(self) -> int:
        return sum(self.tokens)

    def __str__(self) -> str:
        return ",".join(map(str, self.counts)) + "_" + ",".join(map(str, self.tokens))


def parse_tree(spec: str) -> TreeSpec:
    """Parse ``"c1,c2,..._t1,t2,..."``; counts must divide each other down the levels."""
    try:
        left, right = spec.strip().split("_")
        counts = tuple(int(x) for x in left.split(","))
        tokens = tuple(int(x) for x in right.split(","))
    except ValueError:
        raise ValueError(
            f"bad tree {spec!r}: expected counts_tokens, e.g. '1,4,64_1024,256,128'"
        ) from None
    if len(counts) != len(tokens) or not counts:
        raise ValueError(f"bad tree {spec!r}: {len(counts)} counts but {len(tokens)} token sizes")
    if any(c <= 0 for c in counts) or any(t <= 0 for t in tokens):
        raise ValueError(f"bad tree {spec!r}: counts and token sizes must be positive")
    for a, b in itertools.pairwise(counts):
        if b % a:
            raise ValueError(f"bad tree {spec!r}: level of {b} nodes under {a} is not uniform")
    return TreeSpec(counts, tokens)


def parse_heads(text: str) -> tuple[int, int]:
    """Query and KV heads from ``"32/8"`` (or ``"32,8"``): positive, the query heads a multiple
    of the KV heads, a group of at most 16."""
    try:
        hq, hkv = (int(x) for x in text.replace(",", "/").split("/"))
    except ValueError:
        raise ValueError(f"wants QO/KV heads, e.g. 32/8; got {text!r}") from None
    if hq <= 0 or hkv <= 0 or hq % hkv or hq // hkv > 16:
        raise ValueError(
            f"wants positive QO/KV heads with QO a multiple of KV (group size at most 16); "
            f"got {text!r}"
        )
    return hq, hkv


def read_tree_file(path: str | Path) -> list[str]:
    """Tree specs from a file: one per line, '#' comments."""
    lines = Path(path).read_text().splitlines()
    return [ln.split("#")[0].strip() for ln in lines if ln.split("#")[0].strip()]


def tree_batch(
    spec: str | TreeSpec, page_size: int, seed: int = 0, pad_pages: int = 3
) -> tuple[np.ndarray, np.ndarray]:
    """Block table (int32 [B, max_pages]) and seq_lens (int32 [B]) of a tree batch.

    Rows are padded with ``pad_pages`` extra columns of junk page ids past each request's
    last page, as engines leave them.
    """
    tree = parse_tree(spec) if isinstance(spec, str) else spec
    b = tree.batch_size
    seq_len = tree.seq_len
    pages = -(-seq_len // page_size)
    level_end = np.cumsum(tree.tokens)
    j = np.arange(pages)
    last_token = np.minimum((j + 1) * page_size, seq_len) - 1
    level = np.searchsorted(level_end, last_token, side="right")  # level holding that token
    counts = np.asarray(tree.counts)
    # Node (at ``level``) of each request: uniform fan-out.
    node = (np.arange(b)[:, None] * counts[level][None, :]) // b
    # A page is shared iff it is full and its last token's node is shared; its identity is
    # (level, node, page index). Private pages get keys no other request has.
    key = (level[None, :] * (b + 1) + node) * pages + j[None, :]
    full = ((j + 1) * page_size <= seq_len)[None, :]
    private = ~full | (counts[level][None, :] == b)
    key = np.where(private, -1 - (np.arange(b)[:, None] * pages + j[None, :]), key)
    uniq, ids = np.unique(key, return_inverse=True)
    rng = np.random.default_rng(seed)
    relabel = rng.permutation(len(uniq))
    table = relabel[ids.reshape(b, pages)]
    junk = rng.integers(0, len(uniq), size=(b, pad_pages))
    table = np.concatenate([table, junk], axis=1).astype(np.int32)
    seq_lens = np.full(b, seq_len, dtype=np.int32)
    return table, seq_lens


def num_distinct_pages(block_table: np.ndarray, seq_lens: np.ndarray, page_size: int) -> int:
    """Distinct page ids among the used entries of a block table."""
    used = (seq_lens.astype(np.int64) + page_size - 1) // page_size
    mask = np.arange(block_table.shape[1])[None, :] < used[:, None]
    return len(np.unique(block_table[mask]))
