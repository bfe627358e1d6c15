"""``PrefixAttention.plan_unshared``: a plan from host lengths alone, its page ids gathered from
the block table on the table's device. It must equal plain attention for any batch (shared
pages included) and name every bad input."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from conftest import Batch, batches, embed_rows, random_cache, read_entries, read_pages
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixattn import PrefixAttention, SharingProbe, attention_reference, shares_pages
from prefixattn.plan.device_table import hint_positions, item_rows, position_runs
from prefixattn.plan.types import PlanArrays


@settings(max_examples=80, deadline=None)
@given(
    batches(),
    st.sampled_from([(4, 4), (8, 2), (7, 1)]),
    st.booleans(),
    st.integers(0, 3),
    st.sampled_from(["NHD", "HND"]),
)
def test_equals_plain_attention(
    batch: Batch, heads: tuple[int, int], split_kv: bool, extra_rows: int, layout: str
) -> None:
    hq, hkv = heads
    d = 64
    k, v = random_cache(batch.num_pages, batch.page_size, hkv, d, torch.float32, layout)
    q = torch.randn(int(batch.qo_indptr[-1]), hq, d, generator=torch.Generator().manual_seed(1))
    # The requests' rows sit at shuffled places of a larger table, behind junk rows.
    big, rows = embed_rows(batch, extra_rows, 2, np.random.default_rng(0))
    pa = PrefixAttention(hq, hkv, d, batch.page_size, kv_layout=layout, dtype=torch.float32)
    pa.split_target = 0  # split every long request: parts of one row read its pages
    plan = pa.plan_unshared(
        torch.from_numpy(big), batch.seq_lens, batch.qo_indptr, rows=rows, split_kv=split_kv
    )
    assert plan.packing == "per_query" and plan.max_page_id == -1
    out = pa.run(q, k, v, plan=plan)
    ref = attention_reference(
        q.double(),
        k.double(),
        v.double(),
        torch.from_numpy(batch.block_table),
        torch.from_numpy(batch.seq_lens),
        torch.from_numpy(batch.qo_indptr),
        kv_layout=layout,
    )
    if out.numel():
        scale = ref.abs().max().item()
        assert (out.double() - ref).abs().max().item() <= 1e-5 * max(scale, 1e-30)
    # Same work items as the per_query packing of the gathered rows.
    same = pa.plan(
        batch.block_table, batch.seq_lens, batch.qo_indptr, packing="per_query", split_kv=split_kv
    )
    assert plan.num_work_items == same.num_work_items
    assert read_pages(plan) == read_pages(same)
    assert np.array_equal(plan.host.kv_len, same.host.kv_len)


def test_host_arrays_keep_table_positions() -> None:
    table = torch.tensor([[5, 6, 0], [9, 9, 9], [7, 8, 1]], dtype=torch.int32)
    pa = PrefixAttention(4, 2, 64, 2, dtype=torch.float32)
    plan = pa.plan_unshared(table, np.array([3, 4]), rows=np.array([2, 0]))
    # The items read positions row * 3 + column (in the packer's order); the device holds
    # the ids there.
    indptr, row_of = np.arange(3), np.array([2, 0])
    positions = hint_positions(plan.host, indptr, row_of, 3, 2)
    read = read_entries(plan.host, 2)
    assert sorted(positions[read].tolist()) == [0, 1, 6, 7]
    assert read_pages(plan) == table.flatten()[positions[read]].tolist()


def _pa() -> PrefixAttention:
    return PrefixAttention(4, 2, 64, 4, dtype=torch.float32)


@pytest.mark.parametrize(
    ("table", "lens", "kwargs", "error", "match"),
    [
        (np.zeros((2, 2), np.int32), [1, 1], {}, TypeError, "must be a torch.Tensor"),
        (torch.zeros(2, 2, dtype=torch.int64), [1, 1], {}, TypeError, "int32"),
        (torch.zeros(2, dtype=torch.int32), [1, 1], {}, ValueError, "2-D"),
        (torch.zeros(2, 2, dtype=torch.int32).t(), [1, 1], {}, ValueError, "contiguous"),
        (torch.zeros(2, 2, dtype=torch.int32), [9, 1], {}, ValueError, "needs 3 pages"),
        (
            torch.zeros(2, 2, dtype=torch.int32),
            [1, 1],
            {"rows": np.array([0, 2])},
            IndexError,
            "rows",
        ),
        (
            torch.zeros(2, 2, dtype=torch.int32),
            [1, 1],
            {"rows": np.array([0])},
            ValueError,
            "rows has 1",
        ),
        (torch.zeros(2, 2, dtype=torch.int32), [1, -1], {}, ValueError, "negative"),
        (torch.zeros(2, 2, dtype=torch.int32), [1, 1], {"split_kv": 1}, TypeError, "split_kv"),
    ],
)
def test_bad_inputs_are_named(table, lens, kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        _pa().plan_unshared(table, np.array(lens), **kwargs)


def test_table_on_another_device_is_refused() -> None:
    pa = _pa()
    table = torch.zeros(2, 2, dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match="is on meta"):
        pa.plan_unshared(table, np.array([1, 1]))


def test_sharing_probe_on_host_tensors() -> None:
    probe = SharingProbe()
    assert probe.sharing is None and probe.expects_sharing()
    probe.start(torch.tensor([4, 9, 2], dtype=torch.int32))
    assert probe.sharing is False and not probe.expects_sharing()
    # Request 2's first page is request 0's; the padding row (also 4) does not count.
    probe.start(torch.tensor([4, 9, 4, 4]), torch.tensor([True, True, True, False]))
    assert probe.sharing is True
    probe.start(torch.tensor([4, 9, 5, 4]), torch.tensor([True, True, True, False]))
    assert probe.sharing is False
    probe.observe(np.array([1, 1]))
    assert probe.expects_sharing()
    assert shares_pages(np.array([3, 1, 3])) and not shares_pages(np.array([], np.int32))


@settings(max_examples=60, deadline=None)
@given(batches(), st.sampled_from([(4, 4), (8, 2)]), st.booleans())
def test_positions_expand_from_runs(batch: Batch, heads: tuple[int, int], split_kv: bool) -> None:
    # The device expands the plan's positions from O(items) runs; they equal the positions
    # computed page by page from each item's row.
    hq, hkv = heads
    big, rows = embed_rows(batch, 2, 2, np.random.default_rng(0))
    pa = PrefixAttention(hq, hkv, 64, batch.page_size, dtype=torch.float32)
    pa.split_target = 0
    plan = pa.plan_unshared(
        torch.from_numpy(big), batch.seq_lens, batch.qo_indptr, rows=rows, split_kv=split_kv
    )
    indptr = np.asarray(batch.qo_indptr, dtype=np.int64)
    row_of = np.asarray(rows, dtype=np.int64)
    width = big.shape[1]
    runs = position_runs(plan.host, item_rows(plan.host, indptr, row_of)[1], width, pa.page_size)
    assert runs is not None
    run_len, run_delta = runs
    assert int(run_len.sum()) == len(plan.host.kv_pages)
    expanded = np.arange(len(plan.host.kv_pages)) + np.repeat(run_delta, run_len)
    positions = hint_positions(plan.host, indptr, row_of, width, pa.page_size)
    read = read_entries(plan.host, pa.page_size)  # not the room left for later steps
    assert np.array_equal(expanded[read], positions[read])
    assert plan.kv_pages[read].tolist() == big.flatten()[positions[read]].tolist()


def test_position_runs_worked_example() -> None:
    host = PlanArrays(
        kv_page_offset=np.array([0, 3], np.int32), kv_pages=np.zeros(5, np.int32),
        kv_start=np.array([0, 4], np.int32), kv_len=np.array([3, 2], np.int32),
        q_indptr=np.array([0, 1, 2], np.int32), q_tokens=np.array([0, 1], np.int32),
        q_limit=np.array([3, 6], np.int32), q_out=np.array([-1, -1], np.int32),
        tile_id=np.zeros(2, np.int32), tile_indptr=np.array([0, 2], np.int32),
        merge_tokens=np.zeros(0, np.int32), merge_indptr=np.zeros(1, np.int32),
        merge_partials=np.zeros(0, np.int32),
    )  # fmt: skip
    runs = position_runs(host, np.array([2, 5]), 100, 1)
    assert runs is not None
    assert runs[0].tolist() == [3, 2] and runs[1].tolist() == [200, 501]
    # Entries that no item covers continue the run before them (room for later steps).
    gap = dataclasses.replace(host, kv_pages=np.zeros(6, np.int32))
    runs = position_runs(gap, np.array([2, 5]), 100, 1)
    assert runs is not None
    assert runs[0].tolist() == [3, 3] and runs[1].tolist() == [200, 501]
    # ... and those before the first run form a run of their own.
    late = dataclasses.replace(
        host, kv_page_offset=np.array([2, 5], np.int32), kv_pages=np.zeros(7, np.int32)
    )
    runs = position_runs(late, np.array([2, 5]), 100, 1)
    assert runs is not None
    assert runs[0].tolist() == [2, 3, 2] and runs[1].tolist() == [0, 198, 499]
    # Items of one stored run that disagree on their row: no runs.
    clash = dataclasses.replace(host, kv_page_offset=np.array([0, 1], np.int32))
    assert position_runs(clash, np.array([2, 5]), 100, 1) is None


def test_chunked_prefill_positions_are_one_run() -> None:
    # 8 row chunks of one request read one row: one run for all of them.
    pa = PrefixAttention(32, 8, 128, 1, dtype=torch.float32)
    table = torch.arange(3 * 4096, dtype=torch.int32).view(3, 4096)
    plan = pa.plan_unshared(table, np.array([4096]), np.array([0, 256]), rows=np.array([1]))
    assert plan.num_work_items == 8
    host = plan.host
    runs = position_runs(host, np.ones(8, np.int64), 4096, 1)
    # One run (with the room after it that later decode steps may fill).
    assert runs is not None and runs[0].tolist() == [len(host.kv_pages)]
    assert runs[1].tolist() == [4096]
    assert read_pages(plan) == list(range(4096, 8192))
