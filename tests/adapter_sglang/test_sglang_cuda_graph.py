"""Decode CUDA graphs, on CPU: the backend's graph hooks driven the way SGLang's decode
graph runner drives them, with SGLang's own padding (its decode buffer registry and replay
view), against plain attention.

The runner calls ``init_cuda_graph_state(max_bs, max_num_tokens)`` once, then for each
captured batch size (largest first) ``init_forward_metadata_out_graph(fb, in_capture=True)``
on a batch of padding rows, and before every replay ``init_forward_metadata_out_graph(view)``
with the real batch padded to the next captured size. On CPU there is no graph to replay, so
the "replay" runs the layers eagerly on the capture-time batch object, whose tensors the
registry refilled in place: the same tensors a replayed graph reads.
"""

from __future__ import annotations

import inspect
import math
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("sglang")

import torch
from sglang.srt.model_executor.cuda_graph_buffer_registry import build_decode_registry
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.model_executor.runner.decode_cuda_graph_runner import build_replay_fb_view
from test_sglang_backend import (  # the autouse single-rank fixture comes along
    DTYPE,
    MAX_CONTEXT,
    _layer,
    _runner,
    _setup,
    _single_rank,  # noqa: F401
    check_against_reference,
)

from prefixattn import PrefixAttention, leaf_split_spare
from prefixattn.adapters.sglang import backend as sglang_backend
from prefixattn.adapters.sglang.backend import PrefixAttnBackend, graph_reservation
from prefixattn.engine import step
from prefixattn.runtime import library

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64
CAPTURE_BS = [4, 12]  # TREE has 8 requests: replayed padded to 12


def _registry(backend: PrefixAttnBackend):
    max_bs = max(CAPTURE_BS)
    return build_decode_registry(
        device=torch.device("cpu"),
        max_bs=max_bs,
        max_num_token=max_bs,
        seq_len_fill_value=backend.get_cuda_graph_seq_len_fill_value(),
        cache_loc_dtype=torch.int64,
        share_pool=False,
    )


def _static_batch(reg, bs: int) -> ForwardBatch:
    """The batch a captured graph of size ``bs`` is recorded with: views of the registry."""

    def slot(name):
        return reg.get_slot(name).slice_for(bs, bs)

    return ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        batch_size=bs,
        input_ids=slot("input_ids"),
        req_pool_indices=slot("req_pool_indices"),
        seq_lens=slot("seq_lens"),
        seq_lens_cpu=slot("seq_lens_cpu"),
        out_cache_loc=slot("out_cache_loc"),
        seq_lens_sum=int(slot("seq_lens").sum()),
        positions=slot("positions"),
    )


def _capture(backend: PrefixAttnBackend, reg, layers, gen) -> dict[int, ForwardBatch]:
    """What the runner does per captured size: plan a batch of padding rows, run the layers."""
    static = {}
    for bs in sorted(CAPTURE_BS, reverse=True):
        fb = _static_batch(reg, bs)
        backend.init_forward_metadata_out_graph(fb, in_capture=True)
        meta = backend.forward_metadata
        assert meta is not None
        assert meta.core is backend.graph_core
        assert meta.plan.num_tokens == bs  # q of the captured graph has bs rows
        for layer in layers:
            q = torch.randn(bs, HEADS * HEAD_DIM, generator=gen, dtype=DTYPE)
            k = torch.randn(bs, KV_HEADS, HEAD_DIM, generator=gen, dtype=DTYPE)
            v = torch.randn(bs, KV_HEADS, HEAD_DIM, generator=gen, dtype=DTYPE)
            out = backend.forward(q, k, v, layer, fb)
            assert torch.isfinite(out).all()
        static[bs] = fb
    return static


@pytest.mark.parametrize("page_size", [1, 4])
def test_replay_of_a_padded_shared_prefix_batch(page_size: int):
    gen = torch.Generator().manual_seed(77 + page_size)
    rows, backend, pool, req_to_token = _setup(page_size, HEADS, KV_HEADS, HEAD_DIM)
    raw_bs = len(rows)
    layers = [_layer(lid, HEADS, KV_HEADS, HEAD_DIM) for lid in range(2)]

    backend.init_cuda_graph_state(max(CAPTURE_BS), max(CAPTURE_BS))
    assert backend.graph_core is not None and backend.graph_core is not backend.core
    reg = _registry(backend)
    static = _capture(backend, reg, layers, gen)
    capture_plan = backend.graph_core.last_plan

    # An eager step between capture and replay (a prefill) plans on the other core.
    for i, row in enumerate(rows):
        req_to_token[i + 1, : len(row)] = torch.tensor(row, dtype=torch.int32)
    seq_lens = [len(r) for r in rows]
    cached = sorted({s for row in rows for s in row[:-1]})
    loc = torch.tensor(cached, dtype=torch.int64)
    for layer in layers:
        k = torch.randn(len(cached), KV_HEADS, HEAD_DIM, generator=gen, dtype=DTYPE)
        v = torch.randn(len(cached), KV_HEADS, HEAD_DIM, generator=gen, dtype=DTYPE)
        pool.set_kv_buffer(layer, loc, k, v)
    extend = ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        batch_size=raw_bs,
        input_ids=torch.zeros(raw_bs, dtype=torch.int64),
        req_pool_indices=torch.arange(1, raw_bs + 1, dtype=torch.int64),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int32),
        out_cache_loc=torch.tensor([r[-1] for r in rows], dtype=torch.int64),
        seq_lens_sum=sum(seq_lens),
        positions=torch.tensor([n - 1 for n in seq_lens], dtype=torch.int64),
    )
    extend.extend_seq_lens = torch.ones(raw_bs, dtype=torch.int32)
    extend.extend_seq_lens_cpu = [1] * raw_bs
    backend.init_forward_metadata(extend)
    assert backend.forward_metadata is not None
    assert backend.forward_metadata.core is backend.core
    assert backend.graph_core.last_plan is capture_plan

    # Replay: the real decode batch, padded by SGLang's registry to the next captured size.
    real = ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        batch_size=raw_bs,
        input_ids=torch.arange(raw_bs, dtype=torch.int64),
        req_pool_indices=torch.arange(1, raw_bs + 1, dtype=torch.int64),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
        seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int64),
        out_cache_loc=torch.tensor([r[-1] for r in rows], dtype=torch.int64),
        seq_lens_sum=sum(seq_lens),
        positions=torch.tensor([n - 1 for n in seq_lens], dtype=torch.int64),
    )
    bs = min(b for b in CAPTURE_BS if b >= raw_bs)
    reg.fill_from(real, raw_bs=raw_bs, padded_bs=bs, raw_num_tokens=raw_bs, padded_num_tokens=bs)
    buffers = SimpleNamespace(
        **{name: reg.get_slot(name).buffer for name in reg.slot_names()},
        encoder_lens=None,
        mamba_track_indices=None,
    )
    extra: dict[str, object] = {}
    if "global_num_tokens_cpu" in inspect.signature(build_replay_fb_view).parameters:
        extra["global_num_tokens_cpu"] = None  # SGLang >= 0.5.21 (no DP attention here)
    view = build_replay_fb_view(
        **extra,
        forward_batch=real,
        buffers=buffers,
        bs=bs,
        raw_bs=raw_bs,
        num_tokens=bs,
        seq_len_fill_value=backend.get_cuda_graph_seq_len_fill_value(),
        capture_forward_mode=ForwardMode.DECODE,
        is_encoder_decoder=False,
    )
    assert view.num_padding == bs - raw_bs
    backend.init_forward_metadata_out_graph(view)
    meta = backend.forward_metadata
    assert meta is not None
    assert meta.core is backend.graph_core and meta.plan.num_tokens == bs
    assert meta.plan.distinct_kv_bytes < meta.plan.query_centric_kv_bytes  # sharing found

    fb = static[bs]
    assert fb.req_pool_indices[raw_bs:].eq(0).all()  # padding rows: row 0, slot 0
    for layer in layers:
        q = torch.randn(bs, HEADS * HEAD_DIM, generator=gen, dtype=DTYPE)
        k = torch.randn(bs, KV_HEADS, HEAD_DIM, generator=gen, dtype=DTYPE)
        v = torch.randn(bs, KV_HEADS, HEAD_DIM, generator=gen, dtype=DTYPE)
        out = backend.forward(q, k, v, layer, fb)
        assert out.shape == (bs, HEADS * HEAD_DIM)
        assert torch.isfinite(out).all()
        # Real rows' new K/V are in their slots; padding wrote only slot 0.
        torch.testing.assert_close(
            pool.get_key_buffer(layer.layer_id)[real.out_cache_loc], k[:raw_bs]
        )
        check_against_reference(pool, layer, rows, seq_lens, q[:raw_bs], out[:raw_bs])


def _graph_backend():
    backend = PrefixAttnBackend(_runner(1, HEADS, KV_HEADS, HEAD_DIM, max_reqs=4))
    backend.init_cuda_graph_state(4, 4)
    return backend


def _decode_batch(bs: int, seq_len: int = 1) -> ForwardBatch:
    return ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        batch_size=bs,
        input_ids=torch.zeros(bs, dtype=torch.int64),
        req_pool_indices=torch.zeros(bs, dtype=torch.int64),
        seq_lens=torch.full((bs,), seq_len, dtype=torch.int64),
        seq_lens_cpu=torch.full((bs,), seq_len, dtype=torch.int64),
        out_cache_loc=torch.zeros(bs, dtype=torch.int64),
        seq_lens_sum=bs * seq_len,
        positions=torch.zeros(bs, dtype=torch.int64),
    )


def test_graph_hooks_refuse_extend_batches():
    backend = _graph_backend()
    fb = _decode_batch(2)
    fb.forward_mode = ForwardMode.EXTEND
    with pytest.raises(NotImplementedError, match="EXTEND"):
        backend.init_forward_metadata_out_graph(fb, in_capture=True)


def test_graph_hooks_need_init_cuda_graph_state():
    backend = PrefixAttnBackend(_runner(1, HEADS, KV_HEADS, HEAD_DIM, max_reqs=4))
    with pytest.raises(RuntimeError, match="init_cuda_graph_state"):
        backend.init_forward_metadata_out_graph(_decode_batch(2), in_capture=True)


def test_a_plan_that_moves_the_graph_buffers_is_refused(monkeypatch):
    backend = _graph_backend()
    backend.init_forward_metadata_out_graph(_decode_batch(4), in_capture=True)
    # The buffers moved (a plan outgrew them): replaying captured graphs would read freed memory.
    monkeypatch.setattr(PrefixAttention, "buffers_generation", property(lambda self: 99))
    with pytest.raises(RuntimeError, match="outgrew"):
        backend.init_forward_metadata_out_graph(_decode_batch(4))


def test_init_cuda_graph_state_reserves_on_cuda(monkeypatch):
    """On a CUDA device the graph core's buffers are reserved with graph_reservation's sizes
    and the buffers' generation is recorded (no GPU needed: reserve is intercepted)."""
    calls = []
    monkeypatch.setattr(sglang_backend, "core_supports_cuda_graphs", lambda: True)
    monkeypatch.setattr(PrefixAttention, "reserve", lambda self, **kw: calls.append((self, kw)))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a CUDA core, no GPU used
    monkeypatch.setattr(step, "sm_count", lambda device: 132)  # the faked GPU's SMs
    runner = _runner(16, HEADS, KV_HEADS, HEAD_DIM, max_reqs=4)
    backend = PrefixAttnBackend(runner)
    backend.device = torch.device("cuda")
    backend.init_cuda_graph_state(max_bs=48, max_num_tokens=48)
    assert backend.graph_core is not None and backend.graph_core.device.type == "cuda"
    [(core, sizes)] = calls
    assert core is backend.graph_core
    # The fallback of hinted plans is reserved (and launched by the graphs) when they are on.
    assert sizes.pop("hinted") is backend.planner.options.hinted_plans
    spare = backend.planner.spare_slots()
    assert spare >= 1024
    assert sizes == graph_reservation(48, 48, MAX_CONTEXT, 16, spare) == backend.graph_reserved
    assert backend.graph_buffers.captured_generation == backend.graph_core.buffers_generation


def test_cuda_graphs_need_a_graph_safe_core(monkeypatch):
    backend = PrefixAttnBackend(_runner(1, HEADS, KV_HEADS, HEAD_DIM, max_reqs=2))
    backend.device = torch.device("cuda")  # the check runs before any CUDA allocation
    monkeypatch.setattr(sglang_backend, "core_supports_cuda_graphs", lambda: False)
    with pytest.raises(RuntimeError, match="--disable-decode-cuda-graph"):
        backend.init_cuda_graph_state(max_bs=4, max_num_tokens=4)


@pytest.mark.parametrize(
    ("graph_safe", "kernels", "expected"),
    [(False, True, False), (True, False, False), (True, True, True)],
)
def test_core_supports_cuda_graphs(monkeypatch, graph_safe, kernels, expected):
    monkeypatch.setattr(PrefixAttention, "cuda_graph_safe", graph_safe, raising=False)
    monkeypatch.setattr(library, "cuda_ops_available", lambda: kernels)
    assert sglang_backend.core_supports_cuda_graphs() is expected


# ----------------------------------------------------------------- reservation bounds
def _alloc(page_size: int):
    state = {"next": 1}

    def tokens(n: int) -> list[int]:
        first = state["next"] * page_size
        state["next"] += -(-n // page_size)
        return list(range(first, first + n))

    return tokens


def _workload(kind: str, bs: int, ctx: int, page_size: int, seed: int = 0) -> list[list[int]]:
    """Decode batches that stress the plan's sizes at KV lengths up to ``ctx``."""
    tok = _alloc(page_size)
    rng = np.random.default_rng(seed)
    if kind == "long_root":  # all share one long root, 1-token tails: most split parts
        root = tok(ctx - 1)
        return [root + tok(1) for _ in range(bs)]
    if kind == "shared1":
        root = tok(ctx - 64)
        return [root + tok(64) for _ in range(bs)]
    if kind == "three_levels":
        root, mids = tok(ctx // 2), [tok(ctx // 4) for _ in range(4)]
        lows = [tok(ctx // 4 - 8) for _ in range(16)]
        return [root + mids[(i % 16) // 4] + lows[i % 16] + tok(1) for i in range(bs)]
    if kind == "binary":  # a full binary tree: log2(bs) levels
        depth = int(math.log2(bs))
        seg = (ctx - 1) // depth // page_size * page_size
        nodes: dict[tuple[int, int], list[int]] = {}
        out = []
        for i in range(bs):
            row: list[int] = []
            for lvl in range(depth):
                key = (lvl, i >> (depth - lvl - 1))
                if key not in nodes:
                    nodes[key] = tok(seg)
                row += nodes[key]
            out.append(row + tok(1))
        return out
    if kind == "chain":  # request i shares a prefix that grows with i
        step = (ctx - 8) // bs // page_size * page_size
        base = tok(ctx)
        return [base[: i * step] + tok(1 + i % 5) for i in range(bs)]
    if kind == "random":
        roots = [tok(int(rng.integers(1, ctx // 2))) for _ in range(8)]
        out = []
        for _ in range(bs):
            root = roots[int(rng.integers(8))]
            cut = int(rng.integers(0, len(root) + 1)) // page_size * page_size
            out.append(root[:cut] + tok(int(rng.integers(1, ctx // 2))))
        return out
    if kind == "padded":  # half real (sharing), half padding rows (row 0: slot 0, length 1)
        root = tok(ctx - 16)
        return [root + tok(16) for _ in range(bs // 2)] + [[0]] * (bs - bs // 2)
    assert kind == "none"
    return [tok(ctx) for _ in range(bs)]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(32, 8, 128), (32, 4, 256)])
@pytest.mark.parametrize(("max_bs", "ctx"), [(64, 16384), (16, 16384)])
def test_reservation_covers_decode_plans_up_to_max_bs(
    page_size, heads, kv_heads, head_dim, max_bs, ctx
):
    """No decode batch of up to max_bs requests outgrows graph_reservation's sizes: plans of
    stress batches (long shared roots that split into many parts, deep trees, chains, no
    sharing, padding rows) at the largest captured batch size and the longest context. At
    64 requests the split parts are bounded by the context (ctx / 256), at 16 by the node
    count (2 * 16)."""
    spare = max(1024, leaf_split_spare(heads, kv_heads, 132))
    bounds = graph_reservation(max_bs, max_bs, ctx, page_size, spare)
    core = PrefixAttention(heads, kv_heads, head_dim, page_size, dtype=torch.bfloat16)
    kinds = ["long_root", "shared1", "three_levels", "binary", "chain", "random", "padded"]
    for kind in [*kinds, "none"]:
        for bs in (1, 7, max_bs):
            if kind in ("binary", "padded") and bs < 2:
                continue
            rows = _workload(kind, bs if kind != "binary" else 1 << (bs.bit_length() - 1), ctx,
                             page_size)  # fmt: skip
            lens = np.array([len(r) for r in rows], dtype=np.int32)
            assert lens.max() <= ctx
            table = np.zeros((len(rows), -(-ctx // page_size)), dtype=np.int32)
            for i, r in enumerate(rows):
                pages = np.asarray(r[::page_size], dtype=np.int64) // page_size
                table[i, : len(pages)] = pages
            plan = core.plan(table, lens)
            got = {
                "num_work_items": plan.num_work_items,
                "num_pages": len(plan.host.kv_pages),
                "num_slots": max(len(plan.host.q_tokens), plan.num_partials),
                "num_tokens": max(plan.num_tokens, plan.num_merge_tokens),
            }
            over = {k: (got[k], bounds[k]) for k in got if got[k] > bounds[k]}
            assert not over, f"{kind} bs={len(rows)}: {over}"
