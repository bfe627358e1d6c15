"""Plan arrays on a CUDA device live in persistent buffers (stable addresses for graphs)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import read_entries

from prefixattn import PrefixAttention, attention_reference, tree_batch
from prefixattn.plan.device_table import hint_positions
from prefixattn.plan.layout import COUNTS
from prefixattn.plan.planner import DEVICE_ARRAYS
from prefixattn.runtime.buffers import PlanBuffers

pytestmark = pytest.mark.gpu

NAMES = (*DEVICE_ARRAYS, "counts")


def test_addresses_stay_while_plans_fit() -> None:
    pa = PrefixAttention(32, 8, 128, 16, device="cuda")
    pa.reserve(num_work_items=4096, num_pages=1 << 16, num_slots=1 << 14, num_tokens=1024)
    gen = pa.buffers_generation
    addresses = None
    for tree in ("1,4,64_1024,256,128", "2,8,16_256,256,32", "256_1024"):
        table, lens = tree_batch(tree, 16)
        plan = pa.plan(table, lens)
        # The storage, not data_ptr(): an empty view reports address 0.
        now = {n: getattr(plan, n).untyped_storage().data_ptr() for n in NAMES}
        assert addresses is None or now == addresses
        addresses = now
        for n in NAMES[:-1]:
            np.testing.assert_array_equal(getattr(plan, n).cpu().numpy(), getattr(plan.host, n))
        counts = dict(zip(COUNTS, plan.counts.cpu().tolist()[: len(COUNTS)], strict=True))
        assert counts["num_work_items"] == plan.num_work_items
        assert counts["num_tokens"] == plan.num_tokens
    assert pa.buffers_generation == gen


def test_empty_arrays_get_buffers_too() -> None:
    pa = PrefixAttention(8, 2, 64, 16, device="cuda")
    table, lens = tree_batch("256_64", 16)  # nothing shared: no merge arrays
    plan = pa.plan(table, lens)
    assert plan.num_merge_tokens == 0 and plan.merge_tokens.numel() == 0
    assert plan.merge_tokens.is_cuda


def test_growing_bumps_the_generation() -> None:
    pa = PrefixAttention(8, 2, 64, 16, device="cuda")
    table, lens = tree_batch("1,4_32,8", 16)
    pa.plan(table, lens)
    gen = pa.buffers_generation
    table, lens = tree_batch("1,64,512_256,64,40", 16)
    pa.plan(table, lens)
    assert pa.buffers_generation > gen


def test_cuda_run_matches_plain_attention() -> None:
    # Whatever executes the plan on CUDA tensors (kernels or the reference fallback).
    table, lens = tree_batch("1,3,12_96,32,17", 16)
    pa = PrefixAttention(16, 4, 128, 16, device="cuda")
    pa.plan(table, lens)
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (int(table.max()) + 1, 16, 4, 128)
    k = torch.randn(shape, device="cuda", generator=gen, dtype=torch.bfloat16)
    v = torch.randn(shape, device="cuda", generator=gen, dtype=torch.bfloat16)
    q = torch.randn(12, 16, 128, device="cuda", generator=gen, dtype=torch.bfloat16)
    out = pa.run(q, k, v)
    ref = attention_reference(
        q, k, v, torch.from_numpy(table).cuda(), torch.from_numpy(lens).cuda()
    )
    assert (out.float() - ref).abs().max().item() < 2e-2


def test_arrays_loaded_last_time_are_not_copied_again() -> None:
    buffers = PlanBuffers(torch.device("cuda"))
    a = np.arange(10, dtype=np.int32)
    b = np.arange(100, 120, dtype=np.int32)
    counts = np.array([1, 2, 3], np.int32)
    views = buffers.load({"kv_len": a, "q_tokens": b, "counts": counts})
    views["counts"].mul_(0)  # the device changes counts: the next load copies them again
    # A new array under a name is copied; the same object is not (its copy is still there).
    a2 = a + 1
    views = buffers.load({"kv_len": a2, "q_tokens": b, "counts": counts})
    assert views["kv_len"].tolist() == a2.tolist()
    assert views["q_tokens"].tolist() == b.tolist()
    assert views["counts"].tolist() == counts.tolist()
    assert buffers._loaded["q_tokens"] is b and "counts" not in buffers._loaded
    # Growing lays every array out again: all are copied.
    gen = buffers.generation
    big = np.arange(5000, dtype=np.int32)
    views = buffers.load({"kv_len": a2, "q_tokens": b, "counts": counts, "q_out": big})
    assert buffers.generation > gen
    assert views["kv_len"].tolist() == a2.tolist() and views["q_tokens"].tolist() == b.tolist()
    assert views["q_out"].tolist() == big.tolist()


@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_run_reuses_the_page_expansion(page_size: int) -> None:
    # An advanced plan whose pages did not move gathers from the same positions; each step's
    # page ids still come from the table as it is then.
    requests, shared, private = 8, 256, 20
    cols = (shared + private + 40) // page_size + 1
    table = np.empty((requests, cols), np.int32)
    table[:, : shared // page_size] = np.arange(shared // page_size)
    own = cols - shared // page_size
    table[:, shared // page_size :] = 1000 + np.arange(requests * own).reshape(requests, own)
    device_table = torch.from_numpy(table).cuda()
    pa = PrefixAttention(8, 2, 64, page_size, device="cuda")
    lens = np.full(requests, shared + private)
    expansions = []
    for step in range(6):
        if step == 3:
            device_table[:, shared // page_size :] += 5000  # the engine rewrote private pages
        plan = pa.plan_unshared(device_table, lens)
        assert pa._buffers is not None and pa._buffers.positions is not None
        expansions.append(pa._buffers.positions[1])
        positions = hint_positions(plan.host, np.arange(requests + 1), np.arange(requests),
                                   cols, page_size)  # fmt: skip
        read = read_entries(plan.host, page_size)
        flat = device_table.flatten().cpu().numpy()
        assert plan.kv_pages.cpu().numpy()[read].tolist() == flat[positions[read]].tolist()
        lens = lens + 1
    assert all(e is expansions[0] for e in expansions[1:])
