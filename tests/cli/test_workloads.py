"""PAT tree notation and the batches built from it."""

from __future__ import annotations

import numpy as np
import pytest

from prefixattn import PAT_TREES, PrefixAttention, build_forest, parse_tree, tree_batch
from prefixattn.workloads import num_distinct_pages, read_tree_file


def test_parse() -> None:
    t = parse_tree("1,4,64_1024,256,128")
    assert t.counts == (1, 4, 64) and t.tokens == (1024, 256, 128)
    assert t.batch_size == 64 and t.seq_len == 1408 and str(t) == "1,4,64_1024,256,128"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("1,4,64", "counts_tokens"),
        ("1,4_10", "2 counts but 1"),
        ("3,4_8,8", "not uniform"),
        ("1,0_8,8", "positive"),
        ("a_b", "counts_tokens"),
    ],
)
def test_parse_rejects(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_tree(spec)


@pytest.mark.parametrize("page_size", [1, 16, 32, 64])
def test_distinct_pages_match_the_tree(page_size: int) -> None:
    table, lens = tree_batch("1,4,64_1024,256,128", page_size)
    assert table.dtype == np.int32 and table.shape[0] == 64 and (lens == 1408).all()
    expected = 1024 // page_size + 4 * 256 // page_size + 64 * -(-128 // page_size)
    assert num_distinct_pages(table, lens, page_size) == expected


def test_forest_shape_matches_the_tree() -> None:
    table, lens = tree_batch("2,8,16_64,32,5", 16)
    f = build_forest(table, lens, 16)
    depth = f.depth()
    assert [int((depth == d).sum()) for d in range(3)] == [2, 8, 16]
    assert sorted({f.num_requests(u) for u in f.roots}) == [8]


def test_unaligned_levels_are_not_shared() -> None:
    # A 20-token root with page size 16: its second page mixes root and child tokens, so
    # only the first page is shared.
    table, lens = tree_batch("1,4_20,10", 16)
    assert num_distinct_pages(table, lens, 16) == 1 + 4 * 1
    assert len(set(table[:, 0].tolist())) == 1


def test_tree_file_reads_the_suite(tmp_path) -> None:
    """A suite file (one tree a line, '#' comments, blank lines) reads back as the list."""
    lines = ["# the PAT suite", ""] + [f"{spec}  # tree {i}" for i, spec in enumerate(PAT_TREES)]
    path = tmp_path / "pat_trees.txt"
    path.write_text("\n".join(lines) + "\n")
    assert tuple(read_tree_file(path)) == PAT_TREES
    assert all(parse_tree(spec) for spec in PAT_TREES)


def test_bench_suite_is_the_workloads_suite() -> None:
    from prefixattn.bench import PAT_TREES as BENCH_TREES

    assert BENCH_TREES == PAT_TREES


def test_every_suite_tree_plans() -> None:
    pa = PrefixAttention(32, 8, 128, 16)
    for spec in PAT_TREES:
        table, lens = tree_batch(spec, 16)
        plan = pa.plan(table, lens)
        assert plan.distinct_kv_bytes <= plan.kv_bytes <= plan.query_centric_kv_bytes
