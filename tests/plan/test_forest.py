"""Prefix forest construction from block tables."""

from __future__ import annotations

import itertools

import numpy as np
from conftest import Batch, batches
from hypothesis import given, settings

from prefixattn import build_forest


def _paths(forest, num_requests: int) -> dict[int, list[tuple[int, int, int]]]:
    """For each request, the (node, page_begin, page_end) chain from its root to its end."""
    end_of = {}
    for u in range(forest.num_nodes):
        for r in forest.ending(u):
            end_of[int(r)] = u
    paths = {}
    for r, u in end_of.items():
        chain = []
        while u >= 0:
            chain.append((u, int(forest.page_begin[u]), int(forest.page_end[u])))
            u = int(forest.parent[u])
        paths[r] = chain[::-1]
    assert len(paths) <= num_requests
    return paths


def test_worked_example() -> None:
    table = np.array([[7, 3, 5], [7, 3, 9], [7, 4, 0]], dtype=np.int32)
    f = build_forest(table, np.array([6, 5, 3]), page_size=2)
    assert f.num_nodes == 5

    def node(u: int) -> tuple:
        p = int(f.parent[u])
        return (
            int(f.page_begin[u]),
            int(f.page_end[u]),
            int(f.token_end[u]),
            tuple(sorted(f.requests(u).tolist())),
            tuple(sorted(f.requests(p).tolist())) if p >= 0 else None,
        )

    assert sorted(node(u) for u in range(5)) == [
        (0, 1, 2, (0, 1, 2), None),
        (1, 2, 3, (2,), (0, 1, 2)),
        (1, 2, 4, (0, 1), (0, 1, 2)),
        (2, 3, 5, (1,), (0, 1)),
        (2, 3, 6, (0,), (0, 1)),
    ]


def test_identical_and_prefix_rows_end_at_shared_nodes() -> None:
    # Rows 0 and 1 identical; row 2 is a prefix of them; row 3 a different root.
    table = np.array([[4, 5, 6], [4, 5, 6], [4, 5, 9], [8, 1, 2]], dtype=np.int32)
    lens = np.array([5, 6, 3, 2])  # page size 2: rows use 3, 3, 2, 1 pages
    f = build_forest(table, lens, page_size=2)
    assert len(f.roots) == 2
    root = next(u for u in f.roots if f.num_requests(u) == 3)
    assert (int(f.page_begin[root]), int(f.page_end[root])) == (0, 2)
    assert sorted(f.ending(root).tolist()) == [2]
    (child,) = f.children[root]
    assert sorted(f.ending(child).tolist()) == [0, 1]
    assert int(f.token_end[child]) == 6  # the longer of the two identical rows


def test_rows_without_kv_are_left_out() -> None:
    table = np.array([[1, 2], [1, 3], [9, 9]], dtype=np.int32)
    f = build_forest(table, np.array([4, 3, 0]), page_size=2)
    assert sorted(f.order.tolist()) == [0, 1]


@settings(max_examples=200, deadline=None)
@given(batches(max_requests=12, max_pages=8))
def test_forest_reproduces_every_row(batch: Batch) -> None:
    ps = batch.page_size
    f = build_forest(batch.block_table, batch.seq_lens, ps)
    paths = _paths(f, len(batch.seq_lens))
    used = -(-batch.seq_lens.astype(np.int64) // ps)
    assert sorted(paths) == sorted(np.flatnonzero(used > 0).tolist())
    for r, chain in paths.items():
        # The chain tiles the row's used pages exactly, node after node.
        assert chain[0][1] == 0 and chain[-1][2] == used[r]
        for (_, _, e), (_, b, _) in itertools.pairwise(chain):
            assert e == b
        for u, b, e in chain:
            assert r in f.requests(u)
            # All requests of a node hold the same pages there.
            for other in f.requests(u):
                np.testing.assert_array_equal(
                    batch.block_table[other, b:e], batch.block_table[r, b:e]
                )
    # Siblings diverge at their first page (otherwise they would be one node).
    for u in range(f.num_nodes):
        firsts = [int(batch.block_table[f.requests(c)[0], f.page_begin[c]]) for c in f.children[u]]
        assert len(firsts) == len(set(firsts))
    # Node ranges nest: children inside parents, in order.
    for u in range(f.num_nodes):
        p = int(f.parent[u])
        if p >= 0:
            assert f.req_begin[p] <= f.req_begin[u] <= f.req_end[u] <= f.req_end[p]
