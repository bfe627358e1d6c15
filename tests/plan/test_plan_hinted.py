"""``PrefixAttention.plan_hinted``: a prefix-aware plan (decode steps, and steps with prefill
chunks) whose forest comes from a host hint of the block table, page ids from the device table, and a device check that switches to
a per-request fallback when the hint was wrong. It must equal plain attention for any hint,
share pages when the hint is right, and name every bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import Batch, batches, embed_rows, random_cache, read_pages
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixattn import PrefixAttention, TableHint, attention_reference


def _reference(q, k, v, batch: Batch, layout: str = "NHD") -> torch.Tensor:
    return attention_reference(
        q.double(),
        k.double(),
        v.double(),
        torch.from_numpy(batch.block_table),
        torch.from_numpy(batch.seq_lens),
        torch.from_numpy(batch.qo_indptr),
        kv_layout=layout,
    )


def _close(out: torch.Tensor, ref: torch.Tensor) -> None:
    if out.numel():
        scale = max(ref.abs().max().item(), 1e-30)
        assert (out.double() - ref).abs().max().item() <= 1e-5 * scale


def _stale(
    table: np.ndarray, kind: str, gen: np.random.Generator, last_page: np.ndarray
) -> np.ndarray:
    """A hint derived from the true table: exact, missing pages, rows reordered, or junk.
    ``last_page[r]``: the last column row r uses (-1: none)."""
    hint = table.copy()
    if kind == "missing_last":  # each row's last used page unknown (gained since the copy)
        used = last_page >= 0
        hint[np.flatnonzero(used), last_page[used]] = -1
    elif kind == "fewer_rows":
        hint = hint[: max(1, hint.shape[0] // 2)]
    elif kind == "permuted":
        hint = hint[gen.permutation(hint.shape[0])]
    elif kind == "junk":
        hint = gen.integers(0, 3, hint.shape).astype(np.int32)
    return hint


@settings(max_examples=80, deadline=None)
@given(
    st.one_of(batches(decode_only=True), batches()),
    st.sampled_from([(4, 4), (8, 2), (7, 1)]),
    st.sampled_from(["exact", "missing_last", "fewer_rows", "permuted", "junk"]),
    st.integers(0, 2),
)
def test_equals_plain_attention_for_any_hint(
    batch: Batch, heads: tuple[int, int], kind: str, extra_rows: int
) -> None:
    hq, hkv = heads
    d = 64
    k, v = random_cache(batch.num_pages, batch.page_size, hkv, d, torch.float32)
    q = torch.randn(int(batch.qo_indptr[-1]), hq, d, generator=torch.Generator().manual_seed(1))
    gen = np.random.default_rng(0)
    # The requests' rows sit at shuffled places of a larger table, behind junk rows.
    big, rows = embed_rows(batch, extra_rows, 1, gen)
    last_page = np.full(big.shape[0], -1)
    last_page[rows] = -(-batch.seq_lens // batch.page_size) - 1
    hint = _stale(big, kind, gen, last_page)
    pa = PrefixAttention(hq, hkv, d, batch.page_size, dtype=torch.float32)
    pa.split_target = 0  # split long items: parts read runs that start inside the row
    plan = pa.plan_hinted(torch.from_numpy(big), hint, batch.seq_lens, batch.qo_indptr, rows=rows)
    assert plan.fallback is not None and plan.fallback_taken is not None
    assert plan.max_page_id == -1 and plan.fallback.packing == "per_query"
    if kind in ("exact", "missing_last"):
        assert not bool(plan.fallback_taken)
    out = pa.run(q, k, v, plan=plan)
    _close(out, _reference(q, k, v, batch))
    # Exactly one of the two plans keeps its counts.
    taken = bool(plan.fallback_taken)
    assert (plan.counts.abs().sum().item() == 0) == taken
    assert (plan.fallback.counts.abs().sum().item() == 0) == (not taken)


def test_exact_hint_shares_pages() -> None:
    # 6 requests share 3 pages, then 1 private page each (page size 4).
    shared = [10, 11, 12]
    table = np.array([[*shared, 20 + i] for i in range(6)], np.int32)
    lens = np.full(6, 15)
    pa = PrefixAttention(8, 2, 64, 4, dtype=torch.float32)
    plan = pa.plan_hinted(torch.from_numpy(table), table, lens)
    assert not bool(plan.fallback_taken)
    exact = pa.plan(table, lens)
    assert plan.num_work_items == exact.num_work_items < 6 * 2
    assert plan.kv_bytes == exact.kv_bytes
    assert sorted(read_pages(plan)) == sorted(read_pages(exact))
    # One request's shared page changed since the hint: the check catches it.
    now = table.copy()
    now[4, 1] = 30
    plan = pa.plan_hinted(torch.from_numpy(now), table, lens)
    assert bool(plan.fallback_taken)
    assert plan.fallback is not None
    assert plan.fallback.num_work_items == 6


def test_unknown_pages_stay_private() -> None:
    # The hint lacks the last column; two requests' unknown pages must not be taken as shared.
    table = np.array([[1, 2, 5], [1, 2, 6]], np.int32)
    hint = np.array([[1, 2, -1], [1, 2, -1]], np.int32)
    pa = PrefixAttention(4, 2, 64, 2, dtype=torch.float32)
    plan = pa.plan_hinted(torch.from_numpy(table), hint, np.array([6, 6]))
    assert not bool(plan.fallback_taken)
    pages = read_pages(plan)
    assert pages.count(5) == 1 and pages.count(6) == 1 and pages.count(1) == 1


def test_run_uses_the_fallback_when_taken() -> None:
    batch = Batch(
        block_table=np.array([[0, 1], [0, 2]], np.int32),
        seq_lens=np.array([4, 4], np.int32),
        qo_indptr=np.array([0, 1, 2], np.int32),
        page_size=2,
        num_pages=3,
    )
    k, v = random_cache(3, 2, 1, 64, torch.float32)
    q = torch.randn(2, 4, 64)
    pa = PrefixAttention(4, 1, 64, 2, dtype=torch.float32)
    # The hint claims both requests share both pages: wrong for the second page.
    plan = pa.plan_hinted(
        torch.from_numpy(batch.block_table), np.array([[0, 1], [0, 1]]), batch.seq_lens
    )
    assert bool(plan.fallback_taken)
    _close(pa.run(q, k, v), _reference(q, k, v, batch))


def _pa() -> PrefixAttention:
    return PrefixAttention(4, 2, 64, 4, dtype=torch.float32)


@pytest.mark.parametrize(
    ("table", "hint", "lens", "kwargs", "error", "match"),
    [
        (
            np.zeros((2, 2), np.int32),
            np.zeros((2, 2), np.int32),
            [1, 1],
            {},
            TypeError,
            "torch.Tensor",
        ),
        (
            torch.zeros(2, 2, dtype=torch.int64),
            np.zeros((2, 2), np.int32),
            [1, 1],
            {},
            TypeError,
            "int32",
        ),
        (
            torch.zeros(2, 2, dtype=torch.int32),
            np.zeros(2, np.int32),
            [1, 1],
            {},
            ValueError,
            "hint must be 2-D",
        ),
        (
            torch.zeros(2, 2, dtype=torch.int32),
            np.zeros((2, 2), np.float32),
            [1, 1],
            {},
            TypeError,
            "hint must be an integer",
        ),
        (
            torch.zeros(2, 2, dtype=torch.int32),
            np.zeros((2, 2), np.int32),
            [9, 1],
            {},
            ValueError,
            "needs 3 pages",
        ),
        (
            torch.zeros(2, 2, dtype=torch.int32),
            np.full((2, 2), 2**31 - 2, np.int64),
            [1, 1],
            {},
            ValueError,
            "too large",
        ),
        (
            torch.zeros(2, 2, dtype=torch.int32),
            np.zeros((2, 2), np.int32),
            [1, 1],
            {"rows": np.array([0, 5])},
            IndexError,
            "outside block_table",
        ),
    ],
)
def test_bad_input(table, hint, lens, kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        _pa().plan_hinted(table, hint, np.asarray(lens), **kwargs)


def _taken(hint: TableHint) -> np.ndarray:
    """The hint's newest landed copy, which the test expects to exist."""
    taken = hint.take()
    assert taken is not None
    return taken


def test_table_hint_masks_pages_past_each_length() -> None:
    hint = TableHint()
    assert hint.take() is None
    table = torch.tensor([[3, 4, 9], [5, 9, 9]], dtype=torch.int32)
    hint.start(table, np.array([5, 2]), 2)  # CPU table: taken at once
    assert _taken(hint).tolist() == [[3, 4, 9], [5, -1, -1]]
    hint.observe(np.array([[1, 2], [3, 4], [5, 6]]), np.array([1]), 4)
    assert _taken(hint).tolist() == [[1, -1], [-1, -1], [-1, -1]]


def test_table_hint_drops_a_copy_older_than_an_observed_table() -> None:
    hint = TableHint()
    hint._pending = (1, 1, np.array([1]), 1, None)  # a copy in flight (as after start on a GPU)

    class _Landed:
        def query(self) -> bool:
            return True

    hint._event = _Landed()  # type: ignore[assignment]
    hint._pinned = torch.tensor([7], dtype=torch.int32)
    hint.observe(np.array([[5]]), np.array([1]), 1)  # newer, on the host
    assert _taken(hint).tolist() == [[5]]  # the landed copy (7) is older: dropped
    assert hint._pending is None


def test_private_requests_share_nothing() -> None:
    # Request 2 is padding that reads row 0: with private set it joins no shared node.
    table = np.array([[1, 2, 3], [1, 2, 4]], np.int32)
    lens = np.array([6, 6, 1])
    pa = PrefixAttention(4, 2, 64, 2, dtype=torch.float32)
    rows = np.array([0, 1, 0])
    joined = pa.plan_hinted(torch.from_numpy(table), table, lens, rows=rows)
    alone = pa.plan_hinted(
        torch.from_numpy(table), table, lens, rows=rows, private=np.array([False, False, True])
    )
    assert not bool(joined.fallback_taken) and not bool(alone.fallback_taken)

    # Joined, the padding request shares row 0's first page; private, it is a root of its own.
    def root_sizes(plan) -> list[int]:
        return sorted(plan.forest.num_requests(u) for u in plan.forest.roots)

    assert root_sizes(joined) == [3] and root_sizes(alone) == [1, 2]
    with pytest.raises(ValueError, match="private must be a bool array"):
        pa.plan_hinted(torch.from_numpy(table), table, lens, rows=rows, private=np.ones(3))


def test_a_decode_run_plans_from_the_same_tables() -> None:
    """Steps of a decode run with one read-only hint reuse the planning tables (they are made
    wider than needed) and still equal plain attention; a writeable hint is read every call."""
    ps, hq, hkv, d = 1, 8, 2, 64
    shared = list(range(100, 140))
    rows = [shared + list(range(200 + 50 * i, 200 + 50 * i + 30)) for i in range(4)]
    table = np.array(rows, np.int32)
    k, v = random_cache(400, ps, hkv, d, torch.float32)
    pa = PrefixAttention(hq, hkv, d, ps, dtype=torch.float32)
    hint = table.copy()
    hint[:, 50:] = -1  # copied when every request had 50 tokens
    hint.flags.writeable = False
    first = None
    for step_ in range(5):
        lens = np.full(4, 50 + step_)
        plan = pa.plan_hinted(torch.from_numpy(table), hint, lens)
        memo = pa._table_memo["hinted"][1]
        first = memo if first is None else first
        assert memo is first and memo.shape[1] >= 54
        q = torch.randn(4, hq, d, generator=torch.Generator().manual_seed(step_))
        qo = np.arange(5)
        ref = attention_reference(
            q.double(), k.double(), v.double(), torch.from_numpy(table),
            torch.from_numpy(lens), torch.from_numpy(qo),
        )  # fmt: skip
        assert not bool(plan.fallback_taken)
        _close(pa.run(q, k, v, plan=plan), ref)
    writeable = hint.copy()
    pa.plan_hinted(torch.from_numpy(table), writeable, np.full(4, 50))
    memo = pa._table_memo["hinted"][1]
    writeable[:, :40] = 7  # the same array object, other contents: a new table
    pa.plan_hinted(torch.from_numpy(table), writeable, np.full(4, 50))
    assert pa._table_memo["hinted"][1] is not memo


def test_table_hint_refuses_ids_of_another_length() -> None:
    """Request ids must be one per row; a wrong count raises and leaves the hint as it was."""
    hint = TableHint()
    hint.observe(np.array([[1, 2], [3, 4], [5, 6]]), np.array([2, 2, 2]), 1, ids=[7, 8, 9])
    with pytest.raises(ValueError, match="1 request ids for 2 table rows"):
        hint.observe(np.array([[1, 2], [3, 4]]), np.array([2, 2]), 1, ids=[1])
    taken = hint.take()
    assert taken is not None and taken.shape[0] == 3
    assert hint.ids is not None and hint.ids.tolist() == [7, 8, 9]


def test_fallback_is_one_plan_on_the_narrow_table(monkeypatch) -> None:
    """A hinted plan's fallback (per request, run only where the check fails) is built once,
    on the tile table's narrow alternative (16- and 64-row tiles at head_dim 128), rather
    than built on both tables to pick the cheaper; taken, it still equals attention."""
    import prefixattn.attention as attention_module

    ps = 4
    # Three decodes under a 64-token prefix (pages 0-15), then a new request's 32-token
    # prefill chunk (128 query rows at group 4: a 128-row tile on the full table).
    table = np.zeros((4, 17), np.int32)
    for r in range(3):
        table[r, :16] = np.arange(16)
        table[r, 16] = 20 + r
    table[2, 5] = 40  # request 2's page 5 is not the prefix's, as the hint says it is
    table[3, :8] = 50 + np.arange(8)
    hint = table.copy()
    hint[2, 5] = 5
    hint[3] = -1
    batch = Batch(
        block_table=table,
        seq_lens=np.array([66, 66, 66, 32], np.int32),
        qo_indptr=np.array([0, 1, 2, 3, 35], np.int32),
        page_size=ps,
        num_pages=58,
    )
    k, v = random_cache(58, ps, 2, 128, torch.float32)
    q = torch.randn(35, 8, 128)
    pa = PrefixAttention(8, 2, 128, ps, dtype=torch.float32)
    narrow = pa.tiles.narrow()
    assert narrow is not None and 128 not in narrow.m_sizes
    tables: list[tuple[int, ...]] = []
    build = attention_module.build_host_plan

    def counting_build(*args, **kwargs):
        tables.append(tuple(args[5].m_sizes))
        return build(*args, **kwargs)

    monkeypatch.setattr(attention_module, "build_host_plan", counting_build)
    plan = pa.plan_hinted(torch.from_numpy(table), hint, batch.seq_lens, batch.qo_indptr)
    assert bool(plan.fallback_taken)
    assert tables == [narrow.m_sizes, pa.tiles.m_sizes]  # the fallback, then the primary
    assert plan.fallback is not None and {m for m, _ in plan.fallback.tiles} == {64}
    _close(pa.run(q, k, v), _reference(q, k, v, batch))


def _hinted_table_reference(hint, row_of, cols, private=None):
    """The planning table of a hinted plan, entry by entry (prefixattn.plan.device_table)."""
    b = len(row_of)
    base = max(int(hint.max(initial=-1)), -1) + 1
    out = np.empty((b, cols), np.int64)
    for r in range(b):
        known = row_of[r] < hint.shape[0] and not (private is not None and private[r])
        for c in range(cols):
            page = hint[row_of[r], c] if known and c < hint.shape[1] else -1
            out[r, c] = page if page >= 0 else base + r * cols + c
    return out


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_hinted_table_entries(data) -> None:
    """Known pages from the hint's row of each request (rows in order, a permutation, rows
    the hint lacks), a unique id past the hint's largest everywhere else, private requests
    and negative (unknown) hint entries included."""
    from prefixattn.plan.device_table import hinted_table

    rows = data.draw(st.integers(0, 6))
    width = data.draw(st.integers(0, 8))
    entries = st.lists(st.integers(-1, 30), min_size=width, max_size=width)
    table = data.draw(st.lists(entries, min_size=rows, max_size=rows))
    hint = np.array(table, dtype=np.int32).reshape(rows, width)
    b = data.draw(st.integers(1, 7))
    kind = data.draw(st.sampled_from(["in order", "any"]))
    row_of = (
        np.arange(b)
        if kind == "in order"
        else np.array(data.draw(st.lists(st.integers(0, rows + 1), min_size=b, max_size=b)))
    )
    private = data.draw(st.one_of(st.none(), st.lists(st.booleans(), min_size=b, max_size=b)))
    private = None if private is None else np.array(private, dtype=bool)
    cols = data.draw(st.integers(1, 10))
    got = hinted_table(hint, row_of, cols, private)
    assert got.dtype == np.int32 and got.shape == (b, cols)
    assert np.array_equal(got, _hinted_table_reference(hint, row_of, cols, private))
