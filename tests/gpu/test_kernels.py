"""The CUDA kernels against fp32 plain attention: PAT trees, random forests, odd sizes."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from conftest import engine_run

import prefixattn
from prefixattn import LaunchOptions
from prefixattn.runtime.buffers import Workspace
from prefixattn.runtime.launch import run_plan
from prefixattn.workloads import PAT_TREES, tree_batch

from . import KERNEL_MARKS
from .attention_ref import gathered_attention

pytestmark = KERNEL_MARKS

DEV = torch.device("cuda")
EPS = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def make_cache(num_pages, page_size, hkv, d, dtype, layout, interleaved, gen):
    """K and V views; interleaved = one [pages, ps, Hkv, 2, D] tensor (vLLM) or HND views of
    an NHD tensor (non-contiguous token and head strides)."""
    if layout == "NHD" and interleaved:
        kv = torch.randn(num_pages, page_size, hkv, 2, d, generator=gen, device=DEV).to(dtype)
        return kv[:, :, :, 0], kv[:, :, :, 1]
    if layout == "NHD":
        k = torch.randn(num_pages, page_size, hkv, d, generator=gen, device=DEV).to(dtype)
        v = torch.randn(num_pages, page_size, hkv, d, generator=gen, device=DEV).to(dtype)
        return k, v
    if interleaved:
        kv = torch.randn(num_pages, page_size, hkv, 2, d, generator=gen, device=DEV).to(dtype)
        return kv[:, :, :, 0].transpose(1, 2), kv[:, :, :, 1].transpose(1, 2)
    k = torch.randn(num_pages, hkv, page_size, d, generator=gen, device=DEV).to(dtype)
    v = torch.randn(num_pages, hkv, page_size, d, generator=gen, device=DEV).to(dtype)
    return k, v


def assert_close_to_reference(out, ref, dtype, plan, context=""):
    """The kernels' output within 4 ulps of the dtype (relative to the reference's largest
    value, at least 1) plus 1e-3 of the fp32 reference."""
    err = (out.float() - ref).abs().max().item()
    tol = 4 * EPS[dtype] * max(ref.abs().max().item(), 1.0) + 1e-3
    assert err <= tol, f"{context}max error {err} > {tol} ({plan.summary()})"


def tree_inputs(spec, hq, hkv, d, ps, dtype, layout, inter, qlen, seed):
    """PAT tree `spec` at page size `ps`: block table, lengths, query layout (`qlen` tokens per
    request), q and the caches, drawn from one generator seeded with `seed`."""
    table, lens = tree_batch(spec, ps, seed=seed)
    num_pages = int(table.max()) + 1
    gen = torch.Generator(device=DEV).manual_seed(seed)
    k, v = make_cache(num_pages, ps, hkv, d, dtype, layout, inter, gen)
    qo_indptr = (np.arange(len(lens) + 1) * qlen).astype(np.int32)
    q = torch.randn(int(qo_indptr[-1]), hq, d, generator=gen, device=DEV).to(dtype)
    return table, lens, qo_indptr, q, k, v


def launch(plan, q, k, v, out, scale, ws=None, *, finish=True, **options):
    """``run_plan`` with ``LaunchOptions(**options)``; unlike ``PrefixAttention.run``, launches
    are not chained unless ``chain_launches=True``."""
    opts = LaunchOptions(**({"chain_launches": False} | options))
    run_plan(plan, q, k, v, out, scale, Workspace(DEV) if ws is None else ws, opts, finish=finish)


def run_poisoned(plan, q, k, v, scale, **run_args):
    """The plan's output, poisoned with NaN before its run."""
    out = torch.full_like(q, float("nan"))
    launch(plan, q, k, v, out, scale, **run_args)
    return out


def random_forest(rng, page_size, batch, max_shared_pages, max_private):
    """Requests grouped under a few random prefixes of whole pages, plus odd private tails."""
    num_prefixes = int(rng.integers(1, 4))
    prefix_pages = [int(rng.integers(0, max_shared_pages + 1)) for _ in range(num_prefixes)]
    next_page = sum(prefix_pages)
    starts = np.cumsum([0, *prefix_pages])
    rows, lens = [], []
    for _ in range(batch):
        p = int(rng.integers(num_prefixes))
        # Requests may use only part of their prefix, so forests have several depths.
        shared = int(rng.integers(0, prefix_pages[p] + 1))
        tail = int(rng.integers(1, max_private + 1))
        length = shared * page_size + tail
        npriv = -(-tail // page_size)
        row = list(range(starts[p], starts[p] + shared)) + list(range(next_page, next_page + npriv))
        next_page += npriv
        rows.append(row)
        lens.append(length)
    width = max(len(r) for r in rows) + 2
    table = np.full((batch, width), next_page - 1, dtype=np.int32)
    for i, r in enumerate(rows):
        table[i, : len(r)] = r
    return table, np.asarray(lens, dtype=np.int32), next_page


def check(
    hq,
    hkv,
    d,
    page_size,
    dtype,
    layout,
    interleaved,
    table,
    lens,
    num_pages,
    qo_lens,
    packing="memory",
    split_kv=True,
    seed=0,
    fixed_grid=False,
    prefetch_tiles=0,
    concurrent=False,
    one_wave=True,
    chained=False,
    split_target=None,
    narrow=True,
    split_waves=True,
    leaf_split_tokens=64,
):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    t = int(qo_indptr[-1])
    k, v = make_cache(num_pages, page_size, hkv, d, dtype, layout, interleaved, gen)
    q = torch.randn(t, hq, d, generator=gen, device=DEV).to(dtype)
    pa = prefixattn.PrefixAttention(
        hq, hkv, d, page_size, kv_layout=layout, device=DEV, dtype=dtype
    )
    pa.one_launch_in_one_wave = one_wave
    if not narrow:  # the default tile table alone: no narrow alternative plan
        pa.tiles = dataclasses.replace(pa.tiles, narrow_m_sizes=())
    if split_target is not None:
        pa.split_target = split_target
    pa.split_waves = split_waves
    pa.leaf_split_tokens = leaf_split_tokens
    plan = pa.plan(table, lens, qo_indptr, packing=packing, split_kv=split_kv)
    out = torch.full_like(q, float("nan"))
    scale = 1.0 / math.sqrt(d)
    launch(
        plan,
        q,
        k,
        v,
        out,
        scale,
        fixed_grid=fixed_grid,
        prefetch_tiles=prefetch_tiles,
        concurrent_groups=concurrent,
        chain_launches=chained,
    )
    ref = gathered_attention(q, k, v, table, lens, qo_indptr, layout, scale)
    assert not torch.isnan(out).any(), "unwritten output elements"
    assert_close_to_reference(out, ref, dtype, plan)
    return plan


@pytest.mark.parametrize("spec", PAT_TREES)
@pytest.mark.parametrize("heads", [(32, 8), (32, 32)])
def test_pat_tree(spec, heads):
    table, lens = tree_batch(spec, 16, seed=1)
    num_pages = int(table.max()) + 1
    hq, hkv = heads
    check(
        hq,
        hkv,
        128,
        16,
        torch.bfloat16,
        "NHD",
        False,
        table,
        lens,
        num_pages,
        np.ones(len(lens), dtype=np.int32),
    )


@pytest.mark.parametrize("spec", ["1,10_4096,416", "1,4,16,512_1024,256,128,32", "256_1024"])
def test_pat_tree_page1(spec):
    table, lens = tree_batch(spec, 1, seed=2)
    check(
        64,
        8,
        128,
        1,
        torch.bfloat16,
        "NHD",
        True,
        table,
        lens,
        int(table.max()) + 1,
        np.ones(len(lens), dtype=np.int32),
    )


# Odd sizes on purpose: group sizes 1, 3, 4, 7, 16; page sizes 1, 3, 16, 24, 32, 64; tails that end
# mid-page; query lengths 1..5 (causal); head_dim 64, 128, 256.
CASES = [
    # hq, hkv, d, page, dtype, layout, interleaved
    (4, 4, 128, 16, torch.bfloat16, "NHD", False),
    (8, 1, 128, 1, torch.float16, "NHD", True),
    (21, 3, 64, 32, torch.bfloat16, "HND", False),
    (32, 8, 128, 64, torch.float16, "HND", True),
    (16, 1, 64, 16, torch.float16, "NHD", False),
    (12, 4, 256, 16, torch.bfloat16, "NHD", True),
    (14, 2, 256, 1, torch.float16, "HND", False),
    (32, 2, 128, 16, torch.bfloat16, "NHD", False),
    # Page sizes that are not powers of two (the kernels' division path).
    (12, 4, 128, 24, torch.bfloat16, "NHD", True),
    (8, 2, 64, 3, torch.float16, "HND", False),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}x{c[1]}-d{c[2]}-p{c[3]}-{c[5]}")
@pytest.mark.parametrize("packing", ["memory", "naive", "per_query"])
@pytest.mark.parametrize("qlen", [1, 5])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_forest(case, packing, qlen, seed):
    hq, hkv, d, ps, dtype, layout, inter = case
    rng = np.random.default_rng(seed * 100 + hq + d)
    table, lens, num_pages = random_forest(
        rng, ps, int(rng.integers(1, 40)), max(1, 700 // ps), 339
    )
    qo = np.minimum(rng.integers(1, qlen + 1, size=len(lens)), lens).astype(np.int32)
    # Seed 0 chains its launches; seed 1 also takes the fixed-grid launches (as under graph
    # capture) and L2 prefetch; seed 2 runs the tile groups concurrently, seed 1 too (with
    # fixed grids). Seed 2 keeps each item's own tile height in one-wave plans, so small
    # forests still launch several heights (and concurrent groups have several groups to run).
    check(
        hq,
        hkv,
        d,
        ps,
        dtype,
        layout,
        inter,
        table,
        lens,
        num_pages,
        qo,
        packing=packing,
        seed=seed,
        fixed_grid=seed == 1,
        prefetch_tiles=2 * (seed == 1),
        concurrent=seed >= 1,
        one_wave=seed != 2,
        chained=seed == 0,
    )


@pytest.mark.parametrize(
    "case",
    [CASES[0], CASES[1], CASES[3], CASES[4], CASES[8], CASES[9]],
    ids=lambda c: f"{c[0]}x{c[1]}-d{c[2]}-p{c[3]}-{c[5]}",
)
@pytest.mark.parametrize("qlen", [1, 4])
def test_leaf_kernel(case, qlen):
    """The 16-row variant through the leaf kernel (the 16-row tile at head_dim 256): one and
    two passes (group 16, 4-token runs of group 3-4), every page-size path."""
    hq, hkv, d, ps, dtype, layout, inter = case
    rng = np.random.default_rng(7 + hq + ps)
    table, lens, num_pages = random_forest(rng, ps, 33, max(1, 300 // ps), 97)
    qo = np.minimum(rng.integers(1, qlen + 1, size=len(lens)), lens).astype(np.int32)
    plan = check(
        hq, hkv, d, ps, dtype, layout, inter, table, lens, num_pages, qo, seed=3, one_wave=False
    )
    assert any(m == 16 for m, _ in plan.tiles), plan.summary()


@pytest.mark.parametrize("spec", ["1,32_96,50", "1,32_96,20"])
@pytest.mark.parametrize(
    "case",
    [CASES[0], CASES[2], CASES[3], CASES[8], CASES[9]],
    ids=lambda c: f"{c[0]}x{c[1]}-d{c[2]}-p{c[3]}-{c[5]}",
)
def test_narrow_leaf_kernel(case, spec):
    """A plan whose 16-row items have at most 8 rows (one decode token at group <= 8) runs the
    leaf kernel's one-column-block form, and, where those items average at most 3 tiles
    (20-token leaves; 50-token ones average 4), its short form: the reference's values."""
    hq, hkv, d, ps, dtype, layout, inter = case
    table, lens, qo_indptr, q, k, v = tree_inputs(spec, hq, hkv, d, ps, dtype, layout, inter, 1, 5)
    pa = prefixattn.PrefixAttention(hq, hkv, d, ps, kv_layout=layout, device=DEV, dtype=dtype)
    pa.one_launch_in_one_wave = False
    pa.finish_in_leaf = False  # the narrow form runs only where the leaf launch does not finish
    plan = pa.plan(table, lens, qo_indptr)
    assert plan.leaf_max_rows == hq // hkv and plan.num_finished == 0, plan.summary()
    short = plan.leaf_tiles <= 3 * (plan.tile_indptr[1] - plan.tile_indptr[0])
    assert short == (spec.endswith(",20") and ps != 64), plan.summary()  # 64: 52-token leaves
    assert any(m == 16 for m, _ in plan.tiles), plan.summary()
    scale = 1.0 / math.sqrt(d)
    out = run_poisoned(plan, q, k, v, scale, chain_launches=True)
    ref = gathered_attention(q, k, v, table, lens, qo_indptr, layout, scale)
    assert_close_to_reference(out, ref, dtype, plan)


@pytest.mark.parametrize(
    "spec,heads",
    [
        ("300_40", (32, 32)),
        ("300_40", (16, 8)),
        ("2,150_48,24", (64, 8)),
        ("1,4,16,512_64,32,16,8", (32, 32)),
    ],
)
def test_balanced_grid(spec, heads):
    """Launches of more pairs than the GPU holds at once run on a grid that gives every block
    the same number of rounds: the reference's values."""
    check_tree(spec, heads, 16, 1, 6)


@pytest.mark.parametrize(
    "spec, heads, ps, qlen",
    [
        ("1,256_256,32", (32, 8), 16, 1),
        ("1,10_500,40", (64, 8), 1, 2),
        ("1,4,16_96,64,24", (32, 32), 16, 3),
    ],
)
def test_l2_warm_up(spec, heads, ps, qlen):
    """Every forward launch prefetches the plan's arrays and q into the L2: the reference's
    values (leaf, 64-row and 128-row launches, page sizes 16 and 1, causal query runs)."""
    check_tree(spec, heads, ps, qlen, 8)


def check_tree(
    spec, heads, ps, qlen, seed, d=128, layout="NHD", inter=False, min_rows=0, **run_args
):
    """PAT tree `spec` with the default launches: the reference's values (bf16, chained
    launches, leaf finishing as planned). With `min_rows`, the plan must run a tile of at
    least that many rows."""
    hq, hkv = heads
    dtype = torch.bfloat16
    table, lens, qo_indptr, q, k, v = tree_inputs(
        spec, hq, hkv, d, ps, dtype, layout, inter, qlen, seed
    )
    pa = prefixattn.PrefixAttention(hq, hkv, d, ps, kv_layout=layout, device=DEV, dtype=dtype)
    plan = pa.plan(table, lens, qo_indptr)
    assert any(
        m >= min_rows and plan.tile_indptr[t + 1] > plan.tile_indptr[t]
        for t, (m, _) in enumerate(plan.tiles)
    ), plan.summary()
    scale = 1.0 / math.sqrt(d)
    out = run_poisoned(
        plan, q, k, v, scale, chain_launches=True, finish=pa.finish_in_leaf, **run_args
    )
    ref = gathered_attention(q, k, v, table, lens, qo_indptr, layout, scale)
    assert_close_to_reference(out, ref, dtype, plan)


@pytest.mark.parametrize(
    "spec, heads, ps, layout, inter, qlen",
    [
        ("1,64_1024,40", (64, 8), 16, "NHD", False, 1),
        ("1,256_256,32", (32, 8), 1, "HND", True, 1),
        ("1,8,32_700,300,50", (32, 8), 24, "NHD", False, 3),
    ],
)
def test_wgmma_async_full(spec, heads, ps, layout, inter, qlen):
    """The `wgmma` producer's stages signal full as their copies land (up to STAGES tiles in
    flight): the reference's values (128- and 64-row tiles, page sizes 16, 1 and 24, causal
    query runs)."""
    check_tree(spec, heads, ps, qlen, 9, layout=layout, inter=inter, min_rows=64)


@pytest.mark.parametrize(
    "spec, heads, ps, layout, inter, qlen, fixed",
    [
        # root parts of 688 pages at page size 1: past the 512 staged ids
        ("1,10_4096,416", (32, 8), 1, "NHD", False, 1, False),
        ("1,10_4096,416", (64, 8), 16, "HND", True, 1, True),
        ("1,4,16,512_1024,256,128,32", (64, 8), 16, "NHD", False, 1, False),
        # a fixed grid: blocks switch pairs, and stage each pair's ids in turn
        ("1,4,16,512_1024,256,128,32", (32, 8), 1, "HND", False, 1, True),
        ("1,8,32_700,300,50", (32, 8), 24, "NHD", True, 3, True),
    ],
)
def test_wgmma_smem_pages(spec, heads, ps, layout, inter, qlen, fixed):
    """The `wgmma` producer reads each pair's first 512 page ids from shared memory, staged
    when the pair starts: the reference's values (pairs longer than the staged ids, fixed
    grids whose blocks run several pairs, page size 24)."""
    check_tree(spec, heads, ps, qlen, 11, layout=layout, inter=inter, min_rows=64, fixed_grid=fixed)


@pytest.mark.parametrize(
    "spec, heads, d, ps, layout, dtype, qlen, fixed, unsplit",
    [
        ("1,1024_2048,32", (64, 8), 128, 16, "NHD", torch.bfloat16, 1, False, False),
        # a 1040-token root: 17 tiles, so each pair's last step holds one
        ("1,64_1040,40", (64, 8), 128, 24, "HND", torch.float16, 3, True, True),
        ("1,4,16,512_1024,256,128,32", (32, 8), 128, 1, "NHD", torch.bfloat16, 1, False, False),
        ("1,64_1040,40", (64, 8), 64, 16, "NHD", torch.bfloat16, 2, False, True),
        ("1,2,64_1024,256,256", (64, 4), 64, 16, "HND", torch.float16, 1, True, True),
    ],
)
def test_wgmma_keys128(spec, heads, d, ps, layout, dtype, qlen, fixed, unsplit):
    """The 128-row `wgmma` launch's pairs of more than 64 rows and at least 16 tiles take 128
    keys per consumer step: the reference's values (odd tile counts, causal runs, head_dim 64
    and 128, page sizes 1, 16 and 24, fixed grids, plans with their long items left
    unsplit)."""
    hq, hkv = heads
    table, lens, qo_indptr, q, k, v = tree_inputs(
        spec, hq, hkv, d, ps, dtype, layout, False, qlen, 13
    )
    pa = prefixattn.PrefixAttention(hq, hkv, d, ps, kv_layout=layout, device=DEV, dtype=dtype)
    if unsplit:
        pa.split_target = 1  # no item is long against one pair's share of the KV
    plan = pa.plan(table, lens, qo_indptr)
    long_items = plan.host.kv_len[plan.tile_indptr[-2] :] >= 16 * 64
    assert long_items.any(), plan.summary()
    assert any(
        m == 128 and plan.tile_indptr[t + 1] > plan.tile_indptr[t]
        for t, (m, _) in enumerate(plan.tiles)
    ), plan.summary()
    scale = 1.0 / math.sqrt(d)
    out = run_poisoned(
        plan, q, k, v, scale, chain_launches=True, finish=pa.finish_in_leaf, fixed_grid=fixed
    )
    ref = gathered_attention(q, k, v, table, lens, qo_indptr, layout, scale)
    assert_close_to_reference(out, ref, dtype, plan)


@pytest.mark.parametrize(
    "spec, heads, d, ps, qlen",
    [
        ("1,10_4096,416", (32, 8), 128, 16, 1),
        ("1,256_256,32", (32, 8), 128, 1, 1),
        ("256_1024", (32, 8), 128, 16, 1),  # the leaf launch alone, nothing merged
        ("1,4,16,512_1024,256,128,32", (64, 8), 128, 16, 1),
        ("1,8,32_700,300,50", (16, 4), 64, 24, 3),
    ],
)
def test_host_range(spec, heads, d, ps, qlen):
    """Forward launches take their item range from the host (not under a fixed grid, not for
    hinted plans): the reference's values."""
    check_tree(spec, heads, ps, qlen, 17, d=d)


WGMMA64_CASES = [
    # tree, heads, page size, layout, interleaved K|V, query tokens per request
    ("1,256_256,32", (32, 8), 16, "NHD", False, 1),
    ("2,8,16,256_256,256,32,32", (16, 8), 1, "NHD", True, 1),
    ("1,64_300,40", (32, 8), 24, "HND", False, 3),
    ("1,16_333,20", (64, 8), 16, "HND", True, 2),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", WGMMA64_CASES, ids=lambda c: f"{c[0]}-{c[2]}-{c[3]}-q{c[5]}")
def test_wgmma64(case, dtype):
    """The 64-row tiles of the narrow tile table (16- and 64-row tiles) run on the
    one-consumer `wgmma` kernel: the reference's values, for page sizes 16, 1 and 24, NHD and
    HND caches, interleaved K|V and causal query lengths above 1."""
    spec, (hq, hkv), ps, layout, inter, qlen = case
    d = 128
    table, lens, qo_indptr, q, k, v = tree_inputs(
        spec, hq, hkv, d, ps, dtype, layout, inter, qlen, 7
    )
    pa = prefixattn.PrefixAttention(hq, hkv, d, ps, kv_layout=layout, device=DEV, dtype=dtype)
    narrow = pa.tiles.narrow()
    assert narrow is not None and narrow.m_sizes == (16, 64)
    pa.tiles = narrow
    plan = pa.plan(table, lens, qo_indptr)
    assert any(
        m == 64 and plan.tile_indptr[t + 1] > plan.tile_indptr[t]
        for t, (m, _) in enumerate(plan.tiles)
    ), plan.summary()
    scale = 1.0 / math.sqrt(d)
    ref = gathered_attention(q, k, v, table, lens, qo_indptr, layout, scale)
    out = run_poisoned(plan, q, k, v, scale, chain_launches=True, finish=pa.finish_in_leaf)
    assert_close_to_reference(out, ref, dtype, plan)


@pytest.mark.parametrize("scale", [0.0884, 3.0, 0.0, -0.2])
@pytest.mark.parametrize("qlen", [1, 3])
def test_scale_and_rising_scores(scale, qlen):
    """Scores that rise along the KV (a new row maximum in most tiles, by far more than the
    `wgmma` kernel's rescale slack), a large, a zero and a negative scale, through every tile
    height (1,64_1024,40 at group 8: 128-row roots, 16-row leaves; 1,4_512,64: 32-row nodes)."""
    for spec in ("1,64_1024,40", "1,4_512,64"):
        table, lens = tree_batch(spec, 16, seed=4)
        num_pages = int(table.max()) + 1
        gen = torch.Generator(device=DEV).manual_seed(4)
        hq, hkv, d = 64, 8, 128
        u = torch.nn.functional.normalize(torch.randn(d, generator=gen, device=DEV), dim=0)
        # Key t of page p: noise plus (p * 16 + t) / 16 * 2 along u, so q.k grows (or falls,
        # for q.u < 0) by about 2 |q.u| per page.
        pos = torch.arange(num_pages * 16, device=DEV, dtype=torch.float32).view(num_pages, 16)
        noise = torch.randn(num_pages, 16, hkv, d, generator=gen, device=DEV)
        k = (0.5 * noise + (pos / 8)[:, :, None, None] * u).to(torch.bfloat16)
        v = torch.randn(num_pages, 16, hkv, d, generator=gen, device=DEV).to(torch.bfloat16)
        qo = np.minimum(np.full(len(lens), qlen), lens).astype(np.int32)
        qo_indptr = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
        q = torch.randn(int(qo_indptr[-1]), hq, d, generator=gen, device=DEV)
        q = (q + 2 * u).to(torch.bfloat16)  # q.u mostly positive: rising scores
        pa = prefixattn.PrefixAttention(hq, hkv, d, 16, device=DEV, dtype=torch.bfloat16)
        pa.one_launch_in_one_wave = False
        plan = pa.plan(table, lens, qo_indptr)
        out = torch.full_like(q, float("nan"))
        launch(plan, q, k, v, out, scale)
        ref = gathered_attention(q, k, v, table, lens, qo_indptr, "NHD", scale)
        assert not torch.isnan(out).any(), "unwritten output elements"
        assert_close_to_reference(out, ref, torch.bfloat16, plan, f"{spec} scale {scale}: ")


@pytest.mark.parametrize("fixed_grid", [False, True])
def test_chained_launches_match_serial(fixed_grid):
    # Chained launches (each tile height and the merge may start while the launch before it
    # drains) compute exactly what launches that wait for each other compute: same plan,
    # same bits. Several heights per call (one_launch_in_one_wave off) and merged tokens. The
    # partial rows are poisoned before every run, so a merge that read them early would
    # write NaN. In 1,64_64,2048 the first launch (16 rows: long split leaves) is the slow
    # one, so the merge relies on the launches between waiting for it.
    specs = (
        "1,4,16,512_1024,256,128,32",
        "8,16,32,256_512,512,256,32",
        "1,256_256,32",
        "1,64_64,2048",
    )
    for spec in specs:
        table, lens = tree_batch(spec, 16, seed=3)
        num_pages = int(table.max()) + 1
        gen = torch.Generator(device=DEV).manual_seed(3)
        k, v = make_cache(num_pages, 16, 8, 128, torch.bfloat16, "NHD", False, gen)
        q = torch.randn(len(lens), 32, 128, generator=gen, device=DEV).to(torch.bfloat16)
        pa = prefixattn.PrefixAttention(32, 8, 128, 16, device=DEV, dtype=torch.bfloat16)
        pa.one_launch_in_one_wave = False
        plan = pa.plan(table, lens)
        assert len(plan.tiles) > 1 and plan.num_merge_tokens > 0, plan.summary()
        ws = Workspace(DEV, torch.bfloat16)
        ws.reserve(plan.num_partials, 32, 128, torch.bfloat16)
        outs = []
        for chained in (False, True, True, True):
            ws.partial_o.fill_(float("nan"))
            ws.partial_lse.fill_(float("nan"))
            out = torch.full_like(q, float("nan"))
            launch(plan, q, k, v, out, 0.1, ws, fixed_grid=fixed_grid, chain_launches=chained)
            outs.append(out)
        torch.cuda.synchronize()
        for out in outs:
            assert not torch.isnan(out).any(), f"{spec}: NaN (unwritten or early-read partials)"
            assert torch.equal(outs[0], out), spec


@pytest.mark.parametrize("mode", ["finish", "merge_all", "unchained", "concurrent", "fixed"])
def test_leaf_launch_finishes_merged_tokens(mode):
    # Plans whose leaf items finish merged tokens (all of them in 1,256_256,32; some in a
    # random forest with speculative runs) against the reference, with the leaf launch
    # finishing them (last launch, chained or not, or under a fixed grid), and with the merge
    # taking every token (finish off, concurrent groups). Partial rows are poisoned, so a
    # finisher that read one before its launch wrote it, or a merge that read a finished
    # token's unwritten row, writes NaN.
    rng = np.random.default_rng(12)
    forest = random_forest(rng, 16, 60, 40, 97)  # 80 of 101 merged tokens finish
    qo_forest = np.minimum(rng.integers(1, 4, size=60), forest[1]).astype(np.int32)
    batches = [(*tree_batch("1,256_256,32", 16, seed=4), None), (*forest[:2], qo_forest)]
    for table, lens, qo in batches:
        qo = np.ones(len(lens), dtype=np.int32) if qo is None else qo
        qo_indptr = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
        num_pages = int(table.max()) + 1
        gen = torch.Generator(device=DEV).manual_seed(4)
        k, v = make_cache(num_pages, 16, 8, 128, torch.bfloat16, "NHD", False, gen)
        q = torch.randn(int(qo_indptr[-1]), 32, 128, generator=gen, device=DEV).to(torch.bfloat16)
        pa = prefixattn.PrefixAttention(32, 8, 128, 16, device=DEV, dtype=torch.bfloat16)
        pa.one_launch_in_one_wave = False
        plan = pa.plan(table, lens, qo_indptr)
        assert plan.num_finished > 0, plan.summary()
        ws = Workspace(DEV, torch.bfloat16)
        ws.reserve(plan.num_partials, 32, 128, torch.bfloat16)
        ws.partial_o.fill_(float("nan"))
        ws.partial_lse.fill_(float("nan"))
        out = torch.full_like(q, float("nan"))
        launch(
            plan,
            q,
            k,
            v,
            out,
            0.1,
            ws,
            chain_launches=mode != "unchained",
            fixed_grid=mode == "fixed",
            concurrent_groups=mode == "concurrent",
            finish=mode != "merge_all",
        )
        ref = gathered_attention(q, k, v, table, lens, qo_indptr, "NHD", 0.1)
        assert not torch.isnan(out).any(), f"{mode}: unwritten output or early-read partials"
        assert_close_to_reference(out, ref, torch.bfloat16, plan, f"{mode}: ")


@pytest.mark.parametrize(("spec", "target"), [("1,256_4096,32", 132), ("1,128_1024,8", 66)])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("waves", [False, True])
def test_split_waves(spec, target, page_size, waves):
    # Plans whose split chunks take fewer parts (PlanOptions.split_waves, the default) and
    # the split rule's own parts, on the kernels.
    table, lens = tree_batch(spec, page_size, seed=1)
    plan = check(
        32, 8, 128, page_size, torch.bfloat16, "NHD", False, table, lens,
        int(table.max()) + 1, np.ones(len(lens), dtype=np.int32),
        split_target=target, split_waves=waves,
    )  # fmt: skip
    assert plan.num_partials > 0


@pytest.mark.parametrize("floor", [64, 16])
@pytest.mark.parametrize("spec", ["1_1408", "4_1408", "16_1408", "1,4_1024,384"])
@pytest.mark.parametrize("fixed", [False, True])
def test_split_floor(spec, floor, fixed):
    # Small decode batches cut into many short parts (PlanOptions.leaf_split_tokens): up to 88
    # partial rows per token for the merge, on host-sized and fixed grids.
    table, lens = tree_batch(spec, 16, seed=1)
    plan = check(
        32, 8, 128, 16, torch.bfloat16, "NHD", False, table, lens, int(table.max()) + 1,
        np.ones(len(lens), dtype=np.int32), fixed_grid=fixed, leaf_split_tokens=floor,
    )  # fmt: skip
    assert plan.num_partials > 0


@pytest.mark.parametrize("split_kv", [False, True])
def test_long_kv(split_kv):
    # One 4097-token request next to short ones: the split path and many KV tiles.
    table = np.arange(3 * 257, dtype=np.int32).reshape(3, 257)
    lens = np.array([4097, 17, 1], dtype=np.int32)
    check(
        32,
        8,
        128,
        16,
        torch.bfloat16,
        "NHD",
        False,
        table,
        lens,
        3 * 257,
        np.ones(3, dtype=np.int32),
        split_kv=split_kv,
    )


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize(
    ("length", "short", "parts"),
    [(2000, 20, 8), (5000, 30, 20), (8000, 40, 32), (9000, 40, 36), (40000, 100, 94)],
)
def test_merge_many_partials(d, length, short, parts):
    """A long request beside many short ones, every long item cut at the mean node length
    (split_target=0): 8 to 94 partial rows for its token (one warp per head reads them 32 at
    a time, 8 rows per step: one step, a full set of 32, 32 and a few, three sets), 40 query
    heads (a last group of heads that fills part of a merge block), fp16."""
    pages = -(-length // 16)
    num_pages = pages + 3 * short
    table = np.full((1 + short, pages), num_pages - 1, dtype=np.int32)
    table[0] = np.arange(pages)
    for i in range(short):
        table[1 + i, :3] = pages + 3 * i + np.arange(3)
    lens = np.array([length] + [33] * short, dtype=np.int32)
    plan = check(
        40,
        8,
        d,
        16,
        torch.float16,
        "NHD",
        False,
        table,
        lens,
        num_pages,
        np.ones(1 + short, dtype=np.int32),
        split_target=0,
    )
    assert plan.num_merge_tokens == 1
    assert int(np.diff(plan.host.merge_indptr).max()) == parts


# The 128-row tiles (the warpgroup kernel): a shared root read by many query rows, with odd
# lengths, in every dtype, head_dim, layout and page size the kernel takes; query lengths > 1
# put causal masks inside the root's tiles.
ROOT_CASES = [
    # hq, hkv, d, page, dtype, layout, interleaved
    (32, 8, 128, 16, torch.bfloat16, "NHD", False),
    (32, 8, 128, 1, torch.float16, "NHD", True),
    (64, 4, 64, 32, torch.bfloat16, "HND", True),
    (16, 1, 64, 64, torch.float16, "HND", False),
    (24, 3, 128, 16, torch.float16, "NHD", True),
    (32, 8, 128, 24, torch.bfloat16, "HND", False),  # page size not a power of two
]


@pytest.mark.parametrize("case", ROOT_CASES, ids=lambda c: f"{c[0]}x{c[1]}-d{c[2]}-p{c[3]}-{c[5]}")
@pytest.mark.parametrize("qlen", [1, 3])
def test_root_tiles(case, qlen):
    hq, hkv, d, ps, dtype, layout, inter = case
    rng = np.random.default_rng(hq * 7 + d + ps + qlen)
    batch = 96
    root = 333  # tokens, not a multiple of the page or of the 64-key tile
    root_pages = -(-root // ps)
    rows, row_lens, next_page = [], [], root_pages
    for _ in range(batch):
        tail = int(rng.integers(1, 90))
        npriv = -(-tail // ps) + 1  # the root's last page is partly used: tails start afresh
        rows.append(list(range(root_pages)) + list(range(next_page, next_page + npriv)))
        row_lens.append(root_pages * ps + tail)
        next_page += npriv
    width = max(len(r) for r in rows)
    table = np.zeros((batch, width), dtype=np.int32)
    for i, r in enumerate(rows):
        table[i, : len(r)] = r
    lens = np.asarray(row_lens, dtype=np.int32)
    qo = np.full(batch, qlen, dtype=np.int32)
    plan = check(
        hq,
        hkv,
        d,
        ps,
        dtype,
        layout,
        inter,
        table,
        lens,
        next_page,
        qo,
        split_kv=False,
        narrow=False,
    )
    m128 = [i for i, (m, _) in enumerate(plan.tiles) if m == 128]
    assert m128 and any(plan.tile_indptr[t + 1] > plan.tile_indptr[t] for t in m128), plan.summary()


def test_cuda_graph_replay():
    table, lens = tree_batch("1,4,64_1024,256,128", 16, seed=3)
    num_pages = int(table.max()) + 1
    hq, hkv, d = 32, 8, 128
    gen = torch.Generator(device=DEV).manual_seed(0)
    k, v = make_cache(num_pages, 16, hkv, d, torch.bfloat16, "NHD", False, gen)
    pa = prefixattn.PrefixAttention(hq, hkv, d, 16, device=DEV, dtype=torch.bfloat16)
    plan = pa.plan(table, lens)
    q = torch.randn(len(lens), hq, d, generator=gen, device=DEV).to(torch.bfloat16)
    out = torch.empty_like(q)
    ws = Workspace(DEV)
    launch(plan, q, k, v, out, 0.1, ws)  # warm-up: sizes the workspace
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch(plan, q, k, v, out, 0.1, ws)
    q.copy_(torch.randn(q.shape, generator=gen, device=DEV))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    qo = np.arange(len(lens) + 1, dtype=np.int32)
    ref = gathered_attention(q, k, v, table, lens, qo, "NHD", 0.1)
    assert (out.float() - ref).abs().max().item() < 4 * EPS[torch.bfloat16] * 4


def _replay_matches(graph, q, out, k, v, table, lens, gen, label):
    """New q, NaN-poisoned out, replay: out must equal plain attention of the decode batch
    (one token per request) over ``table``."""
    q.copy_(torch.randn(q.shape, generator=gen, device=DEV))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    qo = np.arange(len(lens) + 1, dtype=np.int32)
    ref = gathered_attention(q, k, v, table, lens, qo, "NHD", 1.0 / math.sqrt(q.shape[-1]))
    assert not torch.isnan(out).any(), f"{label}: unwritten output"
    err = (out.float() - ref).abs().max().item()
    assert err < 4 * EPS[torch.bfloat16] * 4, f"{label}: max error {err}"


@pytest.mark.parametrize("mode", ["serial", "concurrent", "chained"])
def test_cuda_graph_replays_new_plans(mode):
    # Capture once, then replay plans of other forests (other item counts, tile heights,
    # merges) with the same number of tokens: the graph reads every size from device memory.
    # With concurrent groups the capture follows the forked streams; chained launches become
    # programmatic edges of the graph.
    hq, hkv, d, ps, b = 32, 8, 128, 16, 64
    gen = torch.Generator(device=DEV).manual_seed(5)
    num_pages = 64 * 80
    k, v = make_cache(num_pages, ps, hkv, d, torch.bfloat16, "NHD", False, gen)
    pa = prefixattn.PrefixAttention(hq, hkv, d, ps, device=DEV, dtype=torch.bfloat16)
    pa.concurrent_groups = mode == "concurrent"
    pa.chain_launches = mode == "chained"
    pa.reserve(
        num_work_items=8 * b + 1024, num_pages=num_pages, num_slots=8 * b + 1024, num_tokens=b
    )
    generation = pa.buffers_generation

    def same_buffers(plan):
        assert pa.buffers_generation == generation, "reserve() was too small for this test"

    # Trees with 64 leaves: one shared root, two levels, nothing shared.
    specs = ["1,64_1024,100", "1,4,64_512,256,33", "64_700", "1,2,64_2048,16,300"]
    _graph_over_specs(pa, k, v, b, specs, num_pages, gen, each=same_buffers)


def _graph_over_specs(pa, k, v, b, specs, num_pages, gen, each=None):
    """Capture ``pa.run`` on the plan of ``specs[0]`` (b decode tokens), then plan every
    spec (the first one last), call ``each(plan)`` and check the graph's replay against
    plain attention; returns q, out, table and lens of the last."""
    q = torch.randn(b, pa.num_qo_heads, pa.head_dim, generator=gen, device=DEV)
    q = q.to(torch.bfloat16)
    out = torch.empty_like(q)

    def batch(spec, seed):
        table, lens = tree_batch(spec, pa.page_size, seed=seed)
        assert len(lens) == b and table.max() < num_pages
        return table, lens

    table, lens = batch(specs[0], 0)
    pa.plan(table, lens)
    pa.run(q, k, v, out=out)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pa.run(q, k, v, out=out)
    for i, spec in enumerate(specs[1:] + specs[:1]):
        table, lens = batch(spec, i + 1)
        plan = pa.plan(table, lens)
        if each is not None:
            each(plan)
        _replay_matches(graph, q, out, k, v, table, lens, gen, spec)
    return q, out, table, lens


@pytest.mark.parametrize(
    ("b", "specs", "variants"),
    [
        (1, ["1_3000", "1_40", "1_9000"], 0b10001),
        (2, ["1,2_2048,100", "2_700", "1,2_64,5000"], 0b10001),
        (8, ["1,8_1024,50", "1,2,8_512,256,33", "8_3000"], 0b10111),
        (9, ["1,9_1024,50", "9_3000"], 0b11111),
    ],
)
def test_small_batch_graphs_launch_fewer_variants(b, specs, variants):
    # A graph captured at b tokens launches only the kernel variants (and the merge) that a
    # plan of at most b tokens can use (TileTable.heights_up_to); plans of long private KV
    # (split items, merges) and of shared roots replay exactly.
    hq, hkv, d, ps = 32, 8, 128, 16
    gen = torch.Generator(device=DEV).manual_seed(b)
    num_pages = 9 * 600
    k, v = make_cache(num_pages, ps, hkv, d, torch.bfloat16, "NHD", False, gen)
    pa = prefixattn.PrefixAttention(hq, hkv, d, ps, device=DEV, dtype=torch.bfloat16)
    pa.reserve(num_work_items=4096, num_pages=num_pages, num_slots=4096, num_tokens=b)

    def within_launches(plan):
        assert {m for m, _ in plan.tiles} <= set(pa.tiles.heights_up_to(b * hq // hkv))

    q, out, table, lens = _graph_over_specs(
        pa, k, v, b, specs, num_pages, gen, each=within_launches
    )
    assert pa._fixed_launches(b) == variants
    # A fixed-grid run outside a graph launches the same variants.
    pa.fixed_grid = True
    out.fill_(float("nan"))
    pa.run(q, k, v, out=out)
    qo = np.arange(len(lens) + 1, dtype=np.int32)
    ref = gathered_attention(q, k, v, table, lens, qo, "NHD", 1.0 / math.sqrt(d))
    assert not torch.isnan(out).any()
    assert (out.float() - ref).abs().max().item() < 4 * EPS[torch.bfloat16] * 4


def test_unsupported_dtype_raises():
    pa = prefixattn.PrefixAttention(4, 4, 128, 16, device=DEV, dtype=torch.bfloat16)
    plan = pa.plan(np.zeros((1, 1), dtype=np.int32), np.array([5], dtype=np.int32))
    q = torch.zeros(1, 4, 128, device=DEV, dtype=torch.float32)
    k = torch.zeros(1, 16, 4, 128, device=DEV, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="float16 and bfloat16"):
        launch(plan, q, k, k, q.clone(), 0.1)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("fixed_grid", [False, True])
def test_plan_unshared_gathers_pages_on_device(page_size, fixed_grid):
    """plan_unshared: the page ids come from a device table (rows at other places of a larger
    table); shared pages are simply read once per request."""
    rng = np.random.default_rng(7)
    table, lens, num_pages = random_forest(rng, page_size, 40, 6, 70)
    qo_lens = rng.integers(1, 4, len(lens)).astype(np.int32)
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    b, w = table.shape
    big = rng.integers(0, num_pages, (b + 5, w + 3)).astype(np.int32)
    rows = rng.permutation(b + 5)[:b]
    big[rows, :w] = table
    gen = torch.Generator(device=DEV).manual_seed(3)
    k, v = make_cache(num_pages, page_size, 8, 128, torch.bfloat16, "NHD", True, gen)
    q = torch.randn(int(qo_indptr[-1]), 32, 128, generator=gen, device=DEV).to(torch.bfloat16)
    pa = prefixattn.PrefixAttention(32, 8, 128, page_size, device=DEV, dtype=torch.bfloat16)
    pa.fixed_grid = fixed_grid
    plan = pa.plan_unshared(torch.from_numpy(big).to(DEV), lens, qo_indptr, rows=rows)
    out = torch.full_like(q, float("nan"))
    pa.run(q, k, v, out=out, plan=plan)
    ref = gathered_attention(q, k, v, table, lens, qo_indptr, "NHD", 1.0 / math.sqrt(128))
    assert not torch.isnan(out).any(), "unwritten output elements"
    err = (out.float() - ref).abs().max().item()
    assert err <= 4 * EPS[torch.bfloat16] * max(ref.abs().max().item(), 1.0) + 1e-3


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("hint_kind", ["exact", "missing_last", "permuted", "one_row"])
def test_plan_hinted_checks_the_hint_on_device(page_size, hint_kind):
    """plan_hinted: a good hint gives the shared plan, a stale one the per-request fallback;
    both equal plain attention, decided on the device without a sync."""
    rng = np.random.default_rng(11)
    table, lens, num_pages = random_forest(rng, page_size, 40, 6, 70)
    b, w = table.shape
    big = rng.integers(0, num_pages, (b + 3, w + 2)).astype(np.int32)
    rows = rng.permutation(b + 3)[:b]
    big[rows, :w] = table
    hint = big.copy()
    if hint_kind == "missing_last":  # each request's last page unknown (gained since)
        hint[rows, -(-lens // page_size) - 1] = -1
    elif hint_kind == "permuted":  # may or may not change the forest
        hint = hint[rng.permutation(hint.shape[0])]
    elif hint_kind == "one_row":  # every request claims row 0's pages: wrong for the tails
        hint = np.tile(big[rows[0]], (big.shape[0], 1))
    gen = torch.Generator(device=DEV).manual_seed(4)
    k, v = make_cache(num_pages, page_size, 8, 128, torch.bfloat16, "NHD", True, gen)
    q = torch.randn(b, 32, 128, generator=gen, device=DEV).to(torch.bfloat16)
    pa = prefixattn.PrefixAttention(32, 8, 128, page_size, device=DEV, dtype=torch.bfloat16)
    plan = pa.plan_hinted(torch.from_numpy(big).to(DEV), hint, lens, rows=rows)
    out = torch.full_like(q, float("nan"))
    pa.run(q, k, v, out=out, plan=plan)
    qo = np.arange(b + 1, dtype=np.int32)
    ref = gathered_attention(q, k, v, table, lens, qo, "NHD", 1.0 / math.sqrt(128))
    assert not torch.isnan(out).any(), "unwritten output elements"
    err = (out.float() - ref).abs().max().item()
    assert err <= 4 * EPS[torch.bfloat16] * max(ref.abs().max().item(), 1.0) + 1e-3
    if hint_kind != "permuted":
        assert bool(plan.fallback_taken) == (hint_kind == "one_row")


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("hint_kind", ["exact", "one_row"])
def test_plan_hinted_with_prefill_chunks(page_size, hint_kind):
    """plan_hinted for a step with prefill chunks beside decode tokens: right with a good hint
    (shared) and a wrong one (the fallback, which then launches the taller tiles too); an
    object whose fallback launches were fixed for graphs refuses such a step."""
    rng = np.random.default_rng(12)
    table, lens, num_pages = random_forest(rng, page_size, 24, 6, 70)
    b = table.shape[0]
    new = np.where(np.arange(b) % 3 == 0, np.minimum(lens, 37), 1)  # every third a chunk
    qo = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    hint = table.copy() if hint_kind == "exact" else np.tile(table[0], (b, 1))
    gen = torch.Generator(device=DEV).manual_seed(5)
    k, v = make_cache(num_pages, page_size, 8, 128, torch.bfloat16, "NHD", True, gen)
    q = torch.randn(int(qo[-1]), 32, 128, generator=gen, device=DEV).to(torch.bfloat16)
    ref = gathered_attention(q, k, v, table, lens, qo, "NHD", 1.0 / math.sqrt(128))
    pa = prefixattn.PrefixAttention(32, 8, 128, page_size, device=DEV, dtype=torch.bfloat16)
    dev_table = torch.from_numpy(table).to(DEV)
    for _ in range(2):  # the second run with the fallback's launches already extended
        plan = pa.plan_hinted(dev_table, hint, lens, qo)
        out = torch.full_like(q, float("nan"))
        pa.run(q, k, v, out=out, plan=plan)
        assert not torch.isnan(out).any(), "unwritten output elements"
        err = (out.float() - ref).abs().max().item()
        assert err <= 4 * EPS[torch.bfloat16] * max(ref.abs().max().item(), 1.0) + 1e-3
        assert bool(plan.fallback_taken) == (hint_kind == "one_row")
    fixed = prefixattn.PrefixAttention(32, 8, 128, page_size, device=DEV, dtype=torch.bfloat16)
    fixed.reserve(num_work_items=4096, num_pages=1 << 16, num_slots=1 << 14, num_tokens=1024,
                  hinted=True)  # fmt: skip
    with pytest.raises(ValueError, match="fixed for decode steps"):
        fixed.plan_hinted(dev_table, hint, lens, qo)


@pytest.mark.parametrize("page_size", [1, 16])
def test_an_engine_run_on_cuda(page_size):
    """The CPU suite's engine run (decode runs, joins with prefill chunks, rows that move) on
    the kernels: advanced plans with room, reused expansions and hint checks, skipped array
    copies and hinted steps with prefill chunks, every step against plain attention."""
    kinds = engine_run(page_size, 3, torch.device(DEV), torch.bfloat16, 3e-2)
    assert kinds.get("hinted", 0) > 10


def test_cuda_graph_replays_hinted_plans():
    """Graphs captured after reserve(hinted=True) replay plain plans, hinted plans with a good
    hint and hinted plans whose check fails (the fallback's launches then do the work)."""
    hq, hkv, d, ps, b = 32, 8, 128, 16, 64
    gen = torch.Generator(device=DEV).manual_seed(6)
    num_pages = 64 * 80
    k, v = make_cache(num_pages, ps, hkv, d, torch.bfloat16, "NHD", False, gen)
    pa = prefixattn.PrefixAttention(hq, hkv, d, ps, device=DEV, dtype=torch.bfloat16)
    # The fallback reads every request's own pages: up to 64 x 2064 tokens of 16.
    pa.reserve(
        num_work_items=8 * b + 1024,
        num_pages=b * 140,
        num_slots=8 * b + 1024,
        num_tokens=b,
        hinted=True,
    )
    generation = pa.buffers_generation
    q = torch.randn(b, hq, d, generator=gen, device=DEV).to(torch.bfloat16)
    out = torch.empty_like(q)
    table, lens = tree_batch("1,64_1024,100", ps, seed=0)
    pa.plan(table, lens)
    pa.run(q, k, v, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pa.run(q, k, v, out=out)
    steps = [
        ("1,4,64_512,256,33", "exact"),
        ("1,64_2048,16", "one_row"),
        ("64_700", "plain"),
        ("1,2,64_1024,16,300", "exact"),
        ("1,64_1024,100", "one_row"),
    ]
    for i, (spec, kind) in enumerate(steps):
        table, lens = tree_batch(spec, ps, seed=i + 1)
        assert len(lens) == b and table.max() < num_pages
        dev_table = torch.from_numpy(table).to(DEV)
        if kind == "plain":
            pa.plan(table, lens)
        else:
            hint = table if kind == "exact" else np.tile(table[0], (b, 1))
            plan = pa.plan_hinted(dev_table, hint, lens)
            assert bool(plan.fallback_taken) == (kind == "one_row"), spec
        assert pa.buffers_generation == generation, "reserve() was too small for this test"
        _replay_matches(graph, q, out, k, v, table, lens, gen, f"{spec} ({kind})")


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize(("ps", "shared"), [(1, 1024), (16, 1024), (1, 0), (16, 0)])
def test_decode_runs_with_advanced_plans(monkeypatch, ps, shared, graph):
    """Decode runs planned as the engine adapters plan them: after the first steps each plan
    is the previous one advanced by a token per request (plan.advance), whose private items
    grow past the 128-token tile-width boundary they were planned with; eager and replayed
    from a CUDA graph captured once. With sharing, a row changes under the hint at step 25
    (the device check of the advanced plan takes the fallback)."""
    import prefixattn.attention as attention_module
    from prefixattn.engine.step import StepPlanner
    from prefixattn.plan.advance import advance

    counts = {"advanced": 0}

    def counted(*args, **kwargs):
        hp = advance(*args, **kwargs)
        counts["advanced"] += hp is not None
        return hp

    monkeypatch.setattr(attention_module, "advance", counted)
    hq, hkv, d, b, steps = 32, 8, 128, 48, 40
    gen = torch.Generator(device=DEV).manual_seed(11)
    width = -(-(shared + 112 + steps + 8) // ps)
    table = (np.arange(b * width).reshape(b, width) + shared // ps).astype(np.int32)
    table[:, : shared // ps] = np.arange(shared // ps)
    k, v = make_cache(int(table.max()) + 1, ps, hkv, d, torch.bfloat16, "NHD", False, gen)
    device_table = torch.from_numpy(table).to(DEV)
    lens = (shared + 110 + np.arange(b) % 3).astype(np.int64)
    indptr = np.arange(b + 1)

    def new_attention():
        return prefixattn.PrefixAttention(hq, hkv, d, ps, device=DEV, dtype=torch.bfloat16)

    planner = StepPlanner(new_attention, ps)
    if graph:
        planner.reserve_graphs(b, b, width * ps)
    attention = planner.attention_for(graph=graph)
    q = torch.randn(b, hq, d, generator=gen, device=DEV).to(torch.bfloat16)
    out = torch.empty_like(q)
    captured = None
    for step in range(steps):
        if shared and step == 25:
            # Row 1 now reads another page where the hint (copied earlier) says it shares
            # page 0: the device check of the advanced plan must take the fallback.
            table[1, 0] = 1
            device_table[1, 0] = 1
        choice = planner.choose(b, decode=True)
        if choice.device_table:
            plan = planner.plan_device(attention, choice, device_table, lens, indptr, num_real=b)
            if shared and step == 25:
                assert plan.fallback_taken is not None and bool(plan.fallback_taken)
        else:
            planner.plan_host(attention, table, lens, indptr, num_real=b)
        if graph:
            planner.check()
            if captured is None:
                attention.run(q, k, v, out=out)
                torch.cuda.synchronize()
                captured = torch.cuda.CUDAGraph()
                with torch.cuda.graph(captured):
                    attention.run(q, k, v, out=out)
            _replay_matches(captured, q, out, k, v, table, lens, gen, f"step {step}")
        else:
            q = torch.randn(b, hq, d, generator=gen, device=DEV).to(torch.bfloat16)
            got = attention.run(q, k, v)
            ref = gathered_attention(q, k, v, table, lens, indptr, "NHD", 1.0 / math.sqrt(d))
            err = (got.float() - ref).abs().max().item()
            assert err < 4 * EPS[torch.bfloat16] * 4, f"step {step}: max error {err}"
        lens = lens + 1
    assert counts["advanced"] >= steps * 3 // 4  # planned afresh every 17 steps
