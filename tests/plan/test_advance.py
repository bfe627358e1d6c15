"""plan.advance: a decode step's plan from the previous step's, checked by running it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from prefixattn import PrefixAttention, attention_reference
from prefixattn.engine.step import StepPlanner
from prefixattn.plan.advance import ADVANCE_STEPS, advance, with_room
from prefixattn.plan.device_table import table_positions
from prefixattn.plan.layout import COUNTS


def _batch(ps, requests, shared, private, steps, seed, groups=2):
    """A block table: every row shares ``shared`` tokens of pages, rows of one group also
    the group's next two pages, then pages of their own (enough for ``steps`` more tokens)."""
    rng = np.random.default_rng(seed)
    width = -(-(shared + private + 2 * ps + steps + 8) // ps) + 2
    table = (np.arange(requests * width).reshape(requests, width) + 1000).astype(np.int32)
    sc = shared // ps
    table[:, :sc] = np.arange(sc)
    for g in range(groups):
        rows = np.arange(g, requests, groups)
        table[rows, sc : sc + 2] = 500 + 2 * g + np.arange(2)
    lens = shared + 2 * ps + private + rng.integers(0, 3, requests)
    return table, lens.astype(np.int64)


def _decode_run(ps, table, lens, steps, *, swap_at=None, seed=0):
    """Plan and run ``steps`` decode steps the way the adapters do; max error per step."""
    gen = torch.Generator().manual_seed(seed)
    requests = table.shape[0]
    num_pages = int(table.max()) + 1
    k = torch.randn(num_pages, ps, 2, 64, generator=gen, dtype=torch.float64)
    v = torch.randn(num_pages, ps, 2, 64, generator=gen, dtype=torch.float64)
    device_table = torch.from_numpy(table.copy())
    planner = StepPlanner(lambda: PrefixAttention(8, 2, 64, ps, dtype=torch.float64), ps)
    attention = planner.attention_for(graph=False)
    indptr = np.arange(requests + 1)
    errors = []
    for step in range(steps):
        if step == swap_at:  # the engine moved two requests' rows: every hint goes stale
            device_table[[0, 1]] = device_table[[1, 0]].clone()
        choice = planner.choose(requests, decode=True)
        if choice.device_table:
            planner.plan_device(attention, choice, device_table, lens, indptr, num_real=requests)
        else:
            planner.plan_host(attention, device_table.numpy(), lens, indptr, num_real=requests)
        q = torch.randn(requests, 8, 64, generator=gen, dtype=torch.float64)
        out = attention.run(q, k, v)
        ref = attention_reference(
            q, k, v, device_table, torch.from_numpy(lens), torch.from_numpy(indptr)
        )
        errors.append((out - ref).abs().max().item())
        lens = lens + 1
    return errors, planner


@pytest.mark.parametrize("ps", [1, 4, 16])
@pytest.mark.parametrize("shared", [0, 48])
def test_decode_runs_advance_their_plans(advances, ps, shared):
    table, lens = _batch(ps, 10, shared, 5, 40, seed=ps)
    errors, planner = _decode_run(ps, table, lens, 40)
    assert max(errors) < 1e-12
    assert planner.plan_kinds["copy"] == 1
    # Each plan kind is planned afresh every ADVANCE_STEPS + 1 steps and advanced otherwise.
    assert advances["advanced"] >= 30
    assert advances["refused"] == 0


def test_a_stale_hint_falls_back_also_when_advanced(advances):
    table, lens = _batch(1, 8, 24, 3, 20, seed=3)
    errors, _ = _decode_run(1, table, lens, 20, swap_at=5)
    assert max(errors) < 1e-12
    assert advances["advanced"] > 0


def test_requests_sharing_their_newest_pages_are_planned_afresh(advances):
    # Every row the same (page size 4, so the newest page is shared too): the item ending at
    # the requests' lengths serves all of them, so no step can be advanced.
    ps, requests, width = 4, 6, 12
    table = np.tile(np.arange(width, dtype=np.int32), (requests, 1))
    lens = np.full(requests, 10, dtype=np.int64)
    errors, planner = _decode_run(ps, table, lens, 6)
    assert max(errors) < 1e-12
    assert planner.plan_kinds["hinted"] == 5
    assert advances["refused"] >= 1


def _unshared_plan(ps=1, requests=4, length=20):
    pa = PrefixAttention(8, 2, 64, ps, dtype=torch.float64)
    width = 64
    table = torch.arange(requests * width, dtype=torch.int32).view(requests, width)
    lens = np.full(requests, length, dtype=np.int64)
    pa.plan_unshared(table, lens)
    memo = next(iter(pa._advance_memo.values()))
    return memo.plan, lens


def test_advance_refuses_what_is_no_decode_step():
    hp, lens = _unshared_plan()
    indptr = np.arange(len(lens) + 1)
    assert advance(hp, lens, lens - 1, indptr, 1, 1) is None  # shorter
    assert advance(hp, lens, lens + 2, indptr, 1, 1) is None  # two tokens
    two = np.array([0, 2, 3, 4, 5])
    assert advance(hp, lens, lens + 1, two, 1, 1) is None  # two query tokens
    assert advance(hp, lens, lens, indptr, 1, 1) is hp  # nothing changed


def test_advance_equals_a_fresh_plan_where_the_shape_is_the_same():
    # Per-request items without splits: the advanced plan is the one planning would give,
    # up to where the pages are stored.
    for ps in (1, 4):
        pa = PrefixAttention(8, 2, 64, ps, dtype=torch.float64)
        requests, width = 5, 32
        device_table = torch.arange(requests * width, dtype=torch.int32).view(requests, width)
        lens = np.array([9, 30, 17, 4, 22], dtype=np.int64)
        pa.plan_unshared(device_table, lens, split_kv=False)
        before = next(iter(pa._advance_memo.values())).plan
        fresh = PrefixAttention(8, 2, 64, ps, dtype=torch.float64)
        fresh.plan_unshared(device_table, lens + 1, split_kv=False)
        expected = next(iter(fresh._advance_memo.values())).plan
        pages = COUNTS.index("num_pages")
        for laid_out in ("with room", "end to end"):
            start = before if laid_out == "with room" else with_room(before, ps, room=0)
            advanced = advance(start, lens, lens + 1, np.arange(requests + 1), ps, 1)
            assert advanced is not None
            want_plan = expected if laid_out == "with room" else with_room(expected, ps, room=0)
            for field in dataclasses.fields(expected.host):
                got = getattr(advanced.host, field.name)
                want = getattr(want_plan.host, field.name)
                if field.name == "kv_pages":  # positions in a fresh plan, zeros when advanced
                    assert len(got) == len(start.host.kv_pages if laid_out == "with room" else want)
                elif field.name == "kv_page_offset" and laid_out == "with room":
                    # The room took the new pages: nothing moved.
                    assert got is start.host.kv_page_offset
                else:
                    np.testing.assert_array_equal(got, want, err_msg=field.name)
            others = np.arange(len(expected.counts)) != pages
            np.testing.assert_array_equal(advanced.counts[others], expected.counts[others])
            assert advanced.counts[pages] == len(advanced.host.kv_pages)
            assert advanced.leaf_tiles == expected.leaf_tiles
            assert advanced.lineage is start.lineage


def test_with_room_worked_example():
    hp, lens = _unshared_plan()
    compact = with_room(hp, 1, room=0)
    npages = compact.host.kv_len.astype(np.int64)
    assert compact.host.kv_page_offset.tolist() == (np.cumsum(npages) - npages).tolist()
    roomy = with_room(compact, 1)
    extra = ADVANCE_STEPS + 1
    size = npages + extra
    assert roomy.host.kv_page_offset.tolist() == (np.cumsum(size) - size).tolist()
    assert len(roomy.host.kv_pages) == int(size.sum())
    assert roomy.counts[COUNTS.index("num_pages")] == int(size.sum())
    # A limit shares what is left of it evenly.
    limited = with_room(compact, 1, room=int(npages.sum()) + 2 * len(npages) + 1)
    assert len(limited.host.kv_pages) == int(npages.sum()) + 2 * len(npages)
    # Advancing ADVANCE_STEPS times fills the room and moves nothing; one more step re-lays.
    step, now = roomy, lens
    for _ in range(extra):
        nxt = advance(step, now, now + 1, np.arange(len(lens) + 1), 1, 1)
        assert nxt is not None
        step, now = nxt, now + 1
        assert step.host.kv_page_offset is roomy.host.kv_page_offset
    nxt = advance(step, now, now + 1, np.arange(len(lens) + 1), 1, 1)
    assert nxt is not None
    size = npages + extra + 1
    assert nxt.host.kv_page_offset.tolist() == (np.cumsum(size) - size).tolist()


def test_plans_are_made_afresh_after_advance_steps(advances):
    table = table_positions(np.arange(3), 200, 200)
    pa = PrefixAttention(8, 2, 64, 1, dtype=torch.float64)
    device_table = torch.from_numpy(table)
    lens = np.full(3, 10, dtype=np.int64)
    for _ in range(ADVANCE_STEPS + 2):
        pa.plan_unshared(device_table, lens)
        lens = lens + 1
    assert advances["advanced"] == ADVANCE_STEPS
    assert next(iter(pa._advance_memo.values())).steps == 0  # the last call planned afresh


def test_a_taken_fallback_leaves_the_advanced_plans_counts_intact():
    # On the CPU the plan's tensors share the host plan's memory; masking a hinted plan's
    # counts (its fallback taken) must not reach the host plan that later steps advance.
    requests, width = 4, 64
    table = (np.arange(requests * width).reshape(requests, width) + 100).astype(np.int32)
    table[:, :8] = np.arange(8)
    hint = table.copy()
    hint.flags.writeable = False
    device_table = torch.from_numpy(table.copy())
    pa = PrefixAttention(8, 2, 64, 1, dtype=torch.float64)
    lens = np.full(requests, 12, dtype=np.int64)
    for step in range(5):
        if step == 2:
            device_table[1, :8] += 500  # the hint goes stale: the fallback is taken
        if step == 3:
            device_table[1, :8] -= 500  # and right again
        plan = pa.plan_hinted(device_table, hint, lens)
        assert plan.fallback is not None
        taken = bool(plan.fallback_taken)
        assert taken == (step == 2)
        used, idle = (plan.fallback, plan) if taken else (plan, plan.fallback)
        assert int(used.counts[0]) == used.num_work_items > 0
        assert int(idle.counts[0]) == 0
        lens = lens + 1


def test_room_only_where_a_plan_can_advance() -> None:
    """Plans of decode steps are laid out with room after each page run (they may be
    advanced); a step with several new tokens for a request never is, so its plan and its
    fallback keep the pages end to end: no room to lay out, no entries to expand."""
    ps = 4
    table = np.zeros((4, 17), np.int32)
    for r in range(3):  # three decodes under a 64-token prefix (pages 0-15), a page each
        table[r, :16] = np.arange(16)
        table[r, 16] = 20 + r
    table[3, :8] = 50 + np.arange(8)  # a new request's 32-token prefill chunk
    hint = table.copy()
    hint[3] = -1
    pa = PrefixAttention(8, 2, 128, ps, dtype=torch.float32)
    decode = pa.plan_hinted(
        torch.from_numpy(table), hint, np.array([66, 66, 66]), np.arange(4), rows=np.arange(3)
    )
    assert decode.kv_pages.numel() > 16 + 3  # the prefix once, three tails, and room
    mixed = pa.plan_hinted(
        torch.from_numpy(table), hint, np.array([66, 66, 66, 32]), np.array([0, 1, 2, 3, 35])
    )
    assert mixed.kv_pages.numel() == 16 + 3 + 8
    assert mixed.fallback is not None and mixed.fallback.kv_pages.numel() == 3 * 17 + 8
