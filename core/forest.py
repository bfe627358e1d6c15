"""Prefix forest from paged-KV block tables.

Rows of a block table that start with identical block ids share that KV. The forest has one
root per distinct first block; a node is a maximal run of pages shared by the same set of
requests; a request ends at the deepest node on its path (usually a leaf holding its private
tail, but identical rows or a row that is a prefix of another end at a shared node).

Requests are renumbered in DFS order (``order``) so that every node's requests are one
contiguous range ``order[req_begin[u]:req_end[u]]``; the forest is built with a handful of
numpy operations per internal node, so a 256 x 4096-slot table (page size 1) takes a few
milliseconds.

Example (page_size 2)::

    block_table = [[7, 3, 5],  seq_lens = [6, 5, 3]
                   [7, 3, 9],
                   [7, 4, 0]]           # row 2 has 2 pages; the 0 past them is ignored
    node 0: pages [0, 1) = [7]      positions [0, 2)  requests {0, 1, 2}
    node 1: pages [1, 2) = [3]      positions [2, 4)  requests {0, 1}      parent 0
    node 2: pages [2, 3) = [5]      positions [4, 6)  request 0            parent 1
    node 3: pages [2, 3) = [9]      positions [4, 5)  request 1            parent 1
    node 4: pages [1, 2) = [4]      positions [2, 3)  request 2            parent 0
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class PrefixForest:
    """Nodes in DFS preorder; a parent precedes its children.

    parent: [N] int32, -1 for a root.
    page_begin, page_end: [N] int32, the node's pages are ``block_table[r, page_begin:page_end]``
        for any request r below it (all equal).
    token_end: [N] int64, one past the last position any request below the node uses inside it
        (``min(page_end * page_size, max seq_len below)``); the node starts at
        ``page_begin * page_size``.
    req_begin, req_end: [N] int32, the node's requests are ``order[req_begin:req_end]``.
    num_ending: [N] int32, how many of them end at this node (they come first in its range).
    order: [B] int32, request ids in DFS order.
    children: list of child-id lists.
    """

    page_size: int
    parent: np.ndarray
    page_begin: np.ndarray
    page_end: np.ndarray
    token_end: np.ndarray
    req_begin: np.ndarray
    req_end: np.ndarray
    num_ending: np.ndarray
    order: np.ndarray
    children: list[list[int]]

    @property
    def num_nodes(self) -> int:
        return len(self.parent)

    @property
    def roots(self) -> list[int]:
        return [int(u) for u in np.flatnonzero(self.parent < 0)]

    def token_begin(self, u: int) -> int:
        return int(self.page_begin[u]) * self.page_size

    def num_requests(self, u: int) -> int:
        return int(self.req_end[u] - self.req_begin[u])

    def requests(self, u: int) -> np.ndarray:
        return self.order[self.req_begin[u] : self.req_end[u]]

    def depth(self) -> np.ndarray:
        d = np.zeros(self.num_nodes, dtype=np.int32)
        for u in range(self.num_nodes):
            if self.parent[u] >= 0:
                d[u] = d[self.parent[u]] + 1
        return d

    def describe(self, max_lines: int = 40) -> str:
        """An indented outline: one line per node, siblings with identical shape folded."""
        lines: list[str] = []
        depth = self.depth()

        def shape(u: int) -> tuple:
            return (
                int(self.token_end[u]) - self.token_begin(u),
                self.num_requests(u),
                tuple(shape(c) for c in self.children[u]),
            )

        def visit(u: int, repeat: int) -> None:
            if len(lines) >= max_lines:
                return
            tokens = int(self.token_end[u]) - self.token_begin(u)
            pages = int(self.page_end[u] - self.page_begin[u])
            kind = "leaf" if not self.children[u] else "node"
            times = f"{repeat} x " if repeat > 1 else ""
            lines.append(
                f"{'  ' * int(depth[u])}{times}{kind}: {tokens} tokens in {pages} pages, "
                f"{self.num_requests(u)} requests"
            )
            kids = self.children[u]
            i = 0
            while i < len(kids):
                j = i
                while j + 1 < len(kids) and shape(kids[j + 1]) == shape(kids[i]):
                    j += 1
                visit(kids[i], j - i + 1)
                i = j + 1

        roots = self.roots
        i = 0
        while i < len(roots):
            j = i
            while j + 1 < len(roots) and shape(roots[j + 1]) == shape(roots[i]):
                j += 1
            visit(roots[i], j - i + 1)
            i = j + 1
        if len(lines) >= max_lines:
            lines.append("  ...")
        return "\n".join(lines)


def build_forest(
    block_table: np.ndarray, seq_lens: np.ndarray, page_size: int
) -> PrefixForest:
    """Build the prefix forest of ``block_table`` rows truncated to their used pages.

    block_table: [B, max_pages] integer; row b's pages are its first
        ``ceil(seq_lens[b] / page_size)`` entries, the rest is ignored.
    seq_lens: [B] integer, KV length of each request (> 0).
    """
    table = np.ascontiguousarray(block_table)
    lens = np.asarray(seq_lens, dtype=np.int64)
    num_pages = (lens + page_size - 1) // page_size

    parent: list[int] = []
    page_begin: list[int] = []
    page_end: list[int] = []
    token_end: list[int] = []
    req_begin: list[int] = []
    req_end: list[int] = []
    num_ending: list[int] = []
    children: list[list[int]] = []
    order: list[int] = []

    def new_node(par: int, begin: int, end: int) -> int:
        u = len(parent)
        parent.append(par)
        page_begin.append(begin)
        page_end.append(end)
        token_end.append(0)
        req_begin.append(len(order))
        req_end.append(0)
        num_ending.append(0)
        children.append([])
        if par >= 0:
            children[par].append(u)
        return u

    def close(u: int, max_len: int) -> None:
        req_end[u] = len(order)
        token_end[u] = min(page_end[u] * page_size, max_len)

    def split(rows: np.ndarray, col: int, par: int) -> None:
        # All ``rows`` agree on columns [0, col) and have more than ``col`` pages.
        vals = table[rows, col]
        if len(rows) == 1:
            r = int(rows[0])
            u = new_node(par, col, int(num_pages[r]))
            order.append(r)
            num_ending[u] = 1
            close(u, int(lens[r]))
            return
        perm = np.argsort(vals, kind="stable")
        rows = rows[perm]
        vals = vals[perm]
        cuts = np.flatnonzero(vals[1:] != vals[:-1]) + 1
        bounds = [0, *cuts.tolist(), len(rows)]
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            grow(rows[a:b], col, par)

    def grow(rows: np.ndarray, begin: int, par: int) -> None:
        # ``rows`` agree on columns [0, begin + 1): extend the shared run as far as it goes.
        if len(rows) == 1:
            split(rows, begin, par)
            return
        np_rows = num_pages[rows]
        limit = int(np_rows.min())
        end = begin + 1
        if limit > end:
            sub = table[rows, end:limit]
            same = (sub == sub[0]).all(axis=0)
            end += int(np.argmin(same)) if not same.all() else limit - end
        u = new_node(par, begin, end)
        ending = rows[np_rows == end]
        order.extend(int(r) for r in ending)
        num_ending[u] = len(ending)
        rest = rows[np_rows > end]
        if len(rest):
            split(rest, end, u)
        close(u, int(lens[rows].max()))

    all_rows = np.flatnonzero(num_pages > 0)
    if len(all_rows):
        split(all_rows, 0, -1)

    return PrefixForest(
        page_size=page_size,
        parent=np.asarray(parent, dtype=np.int32),
        page_begin=np.asarray(page_begin, dtype=np.int32),
        page_end=np.asarray(page_end, dtype=np.int32),
        token_end=np.asarray(token_end, dtype=np.int64),
        req_begin=np.asarray(req_begin, dtype=np.int32),
        req_end=np.asarray(req_end, dtype=np.int32),
        num_ending=np.asarray(num_ending, dtype=np.int32),
        order=np.asarray(order, dtype=np.int32),
        children=children,
    )
