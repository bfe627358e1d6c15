"""Prefix forest from paged-KV block tables.

Rows of a block table that start with identical block ids share that KV. The forest has one
root per distinct first block; a node is a maximal run of pages shared by the same set of
requests; a request ends at the deepest node on its path (usually a leaf holding its private
tail, but identical rows or a row that is a prefix of another end at a shared node).

Requests are listed in DFS order (``order``) so that every node's requests are one
contiguous range ``order[req_begin[u]:req_end[u]]``. The build is one sort and one
vectorised comparison of neighbouring rows plus O(B) host work, so a 256 x 4096-slot table
(page size 1) takes about a millisecond.

Example (page_size 2)::

    block_table = [[7, 3, 5],  seq_lens = [6, 5, 3]
                   [7, 3, 9],
                   [7, 4, 0]]           # row 2 has 2 pages; the 0 past them is ignored
    root   pages [0, 1) = [7]      positions [0, 2)  requests {0, 1, 2}
    ├── pages [1, 2) = [3]          positions [2, 4)  requests {0, 1}
    │   ├── pages [2, 3) = [5]      positions [4, 6)  request 0
    │   └── pages [2, 3) = [9]      positions [4, 5)  request 1
    └── pages [1, 2) = [4]          positions [2, 3)  request 2
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class PrefixForest:
    """Nodes of the forest; ``children`` lists each node's children in ``order``.

    parent: [N] int32, -1 for a root.
    page_begin, page_end: [N] int32, the node's pages are ``block_table[r, page_begin:page_end]``
        for any request r below it (all equal).
    token_end: [N] int64, one past the last position any request below the node uses inside it
        (``min(page_end * page_size, max seq_len below)``); the node starts at
        ``page_begin * page_size``.
    req_begin, req_end: [N] int32, the node's requests are ``order[req_begin:req_end]``.
    order: [B'] int32, the ids of the requests with KV (seq_len > 0) in DFS order.
    ending_indptr: [N+1], ending_reqs: [B'] int32: the requests whose rows end at node u are
        ``ending_reqs[ending_indptr[u]:ending_indptr[u+1]]`` (a leaf's are all of its requests;
        an inner node has some only for identical rows or rows that are prefixes of others).
    children: list of child-id lists, in ``order``.
    """

    page_size: int
    parent: np.ndarray
    page_begin: np.ndarray
    page_end: np.ndarray
    token_end: np.ndarray
    req_begin: np.ndarray
    req_end: np.ndarray
    order: np.ndarray
    ending_indptr: np.ndarray
    ending_reqs: np.ndarray
    children: Sequence[list[int]]

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

    def ending(self, u: int) -> np.ndarray:
        return self.ending_reqs[self.ending_indptr[u] : self.ending_indptr[u + 1]]

    def depth(self) -> np.ndarray:
        d = np.zeros(self.num_nodes, dtype=np.int32)
        todo = self.roots
        while todo:
            u = todo.pop()
            for c in self.children[u]:
                d[c] = d[u] + 1
                todo.append(c)
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
            n = self.num_requests(u)
            lines.append(
                f"{'  ' * int(depth[u])}{times}{kind}: {tokens} tokens in {pages} "
                f"page{'s' * (pages != 1)}, {n} request{'s' * (n != 1)}"
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


def build_forest(block_table: np.ndarray, seq_lens: np.ndarray, page_size: int) -> PrefixForest:
    """Build the prefix forest of ``block_table`` rows truncated to their used pages.

    block_table: [B, max_pages] integer; row b's pages are its first
        ``ceil(seq_lens[b] / page_size)`` entries, the rest is ignored.
    seq_lens: [B] integer, KV length of each request; rows of length 0 are left out.

    Method: sort the rows lexicographically (as byte strings, ends padded with a value below
    every page id, so rows sharing a prefix sit together), take the longest common prefix
    of each neighbouring pair with one vectorised comparison, and build the compressed trie
    from that LCP array with a stack, the way a suffix tree is built from a suffix array.
    """
    lens = np.asarray(seq_lens, dtype=np.int64)
    num_pages = (lens + page_size - 1) // page_size
    rows = np.flatnonzero(num_pages > 0)
    width = int(num_pages[rows].max()) if len(rows) else 0
    # Page ids + 1 as uint32 with 0 past each row's end: a row that ends sorts before the
    # rows that extend it, so every set of rows sharing a prefix is one contiguous run.
    sub = block_table[:, :width] if len(rows) == len(block_table) else block_table[rows, :width]
    if sub.dtype != np.int32:
        sub = sub.astype(np.int32)  # ids beyond int32 are rejected once the plan is packed
    table = sub.view(np.uint32) + np.uint32(1)
    for i in np.flatnonzero(num_pages[rows] < width).tolist():
        table[i, num_pages[rows[i]] :] = 0
    keys = table.view(np.dtype((np.void, 4 * width))).ravel()
    perm = np.argsort(keys, kind="stable")
    order = rows[perm]
    npg = num_pages[order]
    sorted_table = table[perm]
    if len(order) > 1:
        differ = sorted_table[1:] != sorted_table[:-1]
        first = np.where(differ.any(axis=1), differ.argmax(axis=1), width)
        lcp = np.minimum(first, np.minimum(npg[1:], npg[:-1])).tolist()
    else:
        lcp = []
    npg_l = npg.tolist()

    parent: list[int] = []
    page_begin: list[int] = []
    page_end: list[int] = []
    req_begin: list[int] = []
    req_end: list[int] = []
    children: list[list[int]] = []
    end_node = [0] * len(order)

    def new_node(par: int, begin: int, end: int, first_req: int) -> int:
        u = len(parent)
        parent.append(par)
        page_begin.append(begin)
        page_end.append(end)
        req_begin.append(first_req)
        req_end.append(-1)
        children.append([])
        if par >= 0:
            children[par].append(u)
        return u

    stack: list[int] = []  # the open path: the previous row's nodes, root first
    push, pop = stack.append, stack.pop
    add_parent, add_begin, add_end = parent.append, page_begin.append, page_end.append
    add_req_begin, add_req_end, add_children = req_begin.append, req_end.append, children.append
    lcp_prev = [0, *lcp] if npg_l else []
    for i, n, shared in zip(range(len(npg_l)), npg_l, lcp_prev, strict=True):
        while stack and page_begin[stack[-1]] >= shared:
            req_end[pop()] = i
        if stack and page_end[stack[-1]] > shared:
            # Split the node the two rows diverge inside: its shared head becomes a parent.
            v = pop()
            head = new_node(parent[v], page_begin[v], shared, req_begin[v])
            if parent[v] >= 0:
                sibs = children[parent[v]]
                sibs.remove(head)
                sibs[sibs.index(v)] = head
            parent[v] = head
            page_begin[v] = shared
            children[head].append(v)
            req_end[v] = i
            push(head)
        if n > shared:  # a node for the row's own pages (new_node, inlined: the hot path)
            u = len(parent)
            par = stack[-1] if stack else -1
            add_parent(par)
            add_begin(shared)
            add_end(n)
            add_req_begin(i)
            add_req_end(-1)
            add_children([])
            if par >= 0:
                children[par].append(u)
            push(u)
        end_node[i] = stack[-1]
    for u in stack:
        req_end[u] = len(order)

    # A node with children ends at its last page; a leaf (or a node all of whose rows end in
    # it) where its longest row ends.
    num_nodes = len(parent)
    end_arr = np.asarray(end_node, dtype=np.int64)
    ending = np.bincount(end_arr, minlength=num_nodes)
    by_end = np.argsort(end_arr, kind="stable")
    max_len = np.zeros(num_nodes, dtype=np.int64)
    np.maximum.at(max_len, end_arr, lens[order])
    pe = np.asarray(page_end, dtype=np.int64)
    has_kids = np.asarray([bool(c) for c in children])
    return PrefixForest(
        page_size=page_size,
        parent=np.asarray(parent, dtype=np.int32),
        page_begin=np.asarray(page_begin, dtype=np.int32),
        page_end=pe.astype(np.int32),
        token_end=np.where(has_kids, pe * page_size, max_len) if num_nodes else pe,
        req_begin=np.asarray(req_begin, dtype=np.int32),
        req_end=np.asarray(req_end, dtype=np.int32),
        order=order.astype(np.int32),
        ending_indptr=np.concatenate(([0], np.cumsum(ending))).astype(np.int32),
        ending_reqs=order[by_end].astype(np.int32),
        children=children,
    )
