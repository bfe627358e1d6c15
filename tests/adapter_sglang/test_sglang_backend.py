"""The SGLang backend on CPU: SGLang's (0.5.17 through 0.5.23) real memory pools and ForwardBatch, this backend
through SGLang's own ``AttentionBackend.forward`` dispatch, against plain attention.

Batches imitate what the radix cache produces: requests that share a prefix have the same
leading slot ids in their ``req_to_token`` rows (page-aligned runs for page_size > 1), private
tails get fresh slots. The ground truth gathers each request's KV token by token from its
row (``attention_reference`` over a page-size-1 view of the pool), independent of the
backend's page-table translation.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("sglang")

import torch
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.runtime_context import get_parallel

from prefixattn import attention_reference
from prefixattn.adapters.sglang import backend as sglang_backend
from prefixattn.adapters.sglang.backend import PrefixAttnBackend
from prefixattn.engine import step
from prefixattn.engine.step import StepOptions
from prefixattn.runtime import library

DTYPE = torch.float32
MAX_CONTEXT = 384


@pytest.fixture(autouse=True, scope="module")
def _single_rank():
    # No distributed init in unit tests: the attention TP degree is 1.
    override = get_parallel().override(attn_tp_size=1)
    override.__enter__()
    yield
    override.__exit__(None, None, None)


class _ModelConfig:
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        self.num_attention_heads = num_heads
        self.num_key_value_heads = num_kv_heads
        self.head_dim = head_dim

    def get_num_attention_heads(self, tp_size: int) -> int:
        return self.num_attention_heads // tp_size

    def get_num_kv_heads(self, tp_size: int) -> int:
        return self.num_key_value_heads // tp_size


def _runner(page_size: int, num_heads: int, num_kv_heads: int, head_dim: int, max_reqs: int):
    req_pool = ReqToTokenPool(
        size=max_reqs, max_context_len=MAX_CONTEXT, device="cpu", enable_memory_saver=False
    )
    kv_pool = MHATokenToKVPool(
        size=max_reqs * MAX_CONTEXT + page_size,
        page_size=page_size,
        dtype=DTYPE,
        head_num=num_kv_heads,
        head_dim=head_dim,
        layer_num=2,
        device="cpu",
        enable_memory_saver=False,
        enable_alt_stream=False,
    )
    return SimpleNamespace(
        device="cpu",
        page_size=page_size,
        kv_cache_dtype=DTYPE,
        model_config=_ModelConfig(num_heads, num_kv_heads, head_dim),
        req_to_token_pool=req_pool,
        token_to_kv_pool=kv_pool,
        use_mla_backend=False,
        kv_index_translator=None,  # SGLang >= 0.5.19 reads it (HybridAttnBackend, ...)
    )


class _SlotAllocator:
    """Hands out whole pages, from page 1 on (page 0 is SGLang's padding page)."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self.next_page = 1

    def tokens(self, n: int) -> list[int]:
        pages = -(-n // self.page_size)
        first = self.next_page * self.page_size
        self.next_page += pages
        return list(range(first, first + n))


def _rows(tree: list[tuple[tuple[int, ...], int]], page_size: int) -> list[list[int]]:
    """Slot rows for requests described as (prefix path of node ids, private tail length).

    Node ``i`` has length ``NODE_LENS[i] * page_size`` and its slots are shared by every
    request whose path contains it (as the radix cache leaves them).
    """
    alloc = _SlotAllocator(page_size)
    node_slots: dict[int, list[int]] = {}
    rows = []
    for path, tail in tree:
        row: list[int] = []
        for node in path:
            if node not in node_slots:
                node_slots[node] = alloc.tokens(NODE_LENS[node] * page_size)
            row += node_slots[node]
        rows.append(row + alloc.tokens(tail))
    return rows


# Node lengths in pages: odd sizes (1 page, 3, 7, 13) so runs end at odd offsets.
NODE_LENS = {0: 13, 1: 7, 2: 3, 3: 1, 4: 5}
# Two levels under a common root, one request on a separate root, one with nothing shared.
TREE = [
    ((0, 1), 1),
    ((0, 1), 6),
    ((0, 1, 3), 2),
    ((0, 2), 9),
    ((0, 2), 1),
    ((0,), 17),
    ((4,), 3),
    ((), 11),
]


def _setup(page_size: int, num_heads: int, num_kv_heads: int, head_dim: int):
    """The rows of TREE, a backend over a model runner sized for them, its KV pool and its
    req-to-token table (row b + 1 for request b)."""
    rows = _rows(TREE, page_size)
    runner = _runner(page_size, num_heads, num_kv_heads, head_dim, max_reqs=len(rows) + 2)
    backend = PrefixAttnBackend(runner)
    return rows, backend, runner.token_to_kv_pool, runner.req_to_token_pool.req_to_token


def _layer(layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int) -> RadixAttention:
    return RadixAttention(
        num_heads=num_heads,
        head_dim=head_dim,
        scaling=head_dim**-0.5,
        num_kv_heads=num_kv_heads,
        layer_id=layer_id,
    )


def check_against_reference(pool, layer, rows, seq_lens, q, out, qo_indptr=None) -> None:
    """``out`` equals plain attention over each request's KV gathered token by token from its
    ``req_to_token`` row (a page-size-1 view of the pool)."""
    heads, kv_heads, d = layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim
    token_table = torch.zeros(len(rows), MAX_CONTEXT, dtype=torch.int32)
    for i, row in enumerate(rows):
        token_table[i, : len(row)] = torch.tensor(row, dtype=torch.int32)
    k_tok = pool.get_key_buffer(layer.layer_id).view(-1, 1, kv_heads, d)
    v_tok = pool.get_value_buffer(layer.layer_id).view(-1, 1, kv_heads, d)
    expected = attention_reference(
        q.view(-1, heads, d).double(),
        k_tok.double(),
        v_tok.double(),
        token_table,
        torch.tensor(seq_lens, dtype=torch.int32),
        qo_indptr,
        scale=layer.scaling,
    )
    # fp32 inputs; the bound is a few ulps of fp32 times the softmax's accumulation depth.
    tol = 8 * torch.finfo(DTYPE).eps * math.sqrt(MAX_CONTEXT)
    torch.testing.assert_close(out.view(-1, heads, d).double(), expected, atol=tol, rtol=tol)


def _forward_batch(mode: ForwardMode, rows: list[list[int]], new_lens: list[int]) -> ForwardBatch:
    """A ForwardBatch of requests ``1..B`` of the req-to-token pool whose rows are ``rows``, the
    last ``new_lens[b]`` slots of row ``b`` being its new tokens (decode: 1 each)."""
    seq_lens = [len(r) for r in rows]
    prefix_lens = [s - n for s, n in zip(seq_lens, new_lens, strict=True)]
    num_tokens = sum(new_lens)
    batch = ForwardBatch(
        forward_mode=mode,
        batch_size=len(rows),
        input_ids=torch.zeros(num_tokens, dtype=torch.int64),
        req_pool_indices=torch.arange(1, len(rows) + 1, dtype=torch.int64),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int32),
        out_cache_loc=torch.tensor(
            [s for row, p in zip(rows, prefix_lens, strict=True) for s in row[p:]],
            dtype=torch.int64,
        ),
        seq_lens_sum=sum(seq_lens),
        positions=torch.tensor(
            [i for p, s in zip(prefix_lens, seq_lens, strict=True) for i in range(p, s)],
            dtype=torch.int64,
        ),
    )
    if not mode.is_decode():
        batch.extend_prefix_lens = torch.tensor(prefix_lens, dtype=torch.int32)
        batch.extend_prefix_lens_cpu = prefix_lens
        batch.extend_seq_lens = torch.tensor(new_lens, dtype=torch.int32)
        batch.extend_seq_lens_cpu = new_lens
        batch.extend_num_tokens = num_tokens
    return batch


def _run_case(
    page_size: int,
    mode: str,
    num_heads: int = 8,
    num_kv_heads: int = 2,
    unshared: bool = False,
    hint: str | None = None,
):
    head_dim = 64
    gen = torch.Generator().manual_seed(1234 + page_size)
    rows, backend, pool, req_to_token = _setup(page_size, num_heads, num_kv_heads, head_dim)
    bs = len(rows)

    # New tokens per request: decode 1 each; extend a few (cached prefix before them);
    # mixed = extend requests beside decode requests (query length 1), as chunked prefill.
    if mode == "decode":
        new_lens = [1] * bs
    elif mode == "extend":
        new_lens = [min(len(r), n) for r, n in zip(rows, [1, 4, 2, 7, 1, 3, 5, 11], strict=True)]
    else:
        new_lens = [min(len(r), n) for r, n in zip(rows, [1, 1, 5, 1, 1, 3, 1, 11], strict=True)]
    seq_lens = [len(r) for r in rows]
    prefix_lens = [s - n for s, n in zip(seq_lens, new_lens, strict=True)]
    for i, row in enumerate(rows):
        req_to_token[i + 1, : len(row)] = torch.tensor(row, dtype=torch.int32)

    layers = [_layer(lid, num_heads, num_kv_heads, head_dim) for lid in range(2)]
    # Cached tokens (shared prefixes once, tails per request) go into the pool first.
    cached = sorted({s for row, p in zip(rows, prefix_lens, strict=True) for s in row[:p]})
    if cached:
        loc = torch.tensor(cached, dtype=torch.int64)
        for layer in layers:
            k = torch.randn(len(cached), num_kv_heads, head_dim, generator=gen, dtype=DTYPE)
            v = torch.randn(len(cached), num_kv_heads, head_dim, generator=gen, dtype=DTYPE)
            pool.set_kv_buffer(layer, loc, k, v)

    num_tokens = sum(new_lens)
    forward_mode = {
        "decode": ForwardMode.DECODE,
        "extend": ForwardMode.EXTEND,
        "mixed": ForwardMode.MIXED,
    }[mode]
    batch = _forward_batch(forward_mode, rows, new_lens)
    out_cache_loc = batch.out_cache_loc

    # Each case takes one planning path (both switches are on by default).
    planner = backend.planner
    planner.options.unshared_plans = unshared
    planner.options.hinted_plans = hint is not None
    if unshared:  # the last batch looked at shared nothing: plan without the host copy
        planner.probe.observe(np.arange(3))
    if hint is not None:  # an earlier step's copy of the rows, right or in another order
        table, lens, _ = backend._batch_tables(batch)
        planner.table_hint.observe(table if hint == "exact" else table[::-1], lens, page_size)
    backend.init_forward_metadata(batch)
    assert backend.forward_metadata is not None
    plan = backend.forward_metadata.plan
    if hint is not None:
        # Decode and mixed steps take the hint (no wait for this step's rows).
        assert plan.fallback is not None
        if hint == "exact":
            assert not bool(plan.fallback_taken)
            assert plan.distinct_kv_bytes < plan.query_centric_kv_bytes
    elif unshared:
        assert plan.packing == "per_query" and plan.max_page_id == -1
        assert planner.probe.sharing is True  # this batch shares: the next step copies
    else:
        # Shared prefixes are found: fewer distinct KV bytes than one read per request.
        assert plan.distinct_kv_bytes < plan.query_centric_kv_bytes

    qo_indptr = torch.tensor([0, *torch.tensor(new_lens).cumsum(0).tolist()], dtype=torch.int32)
    for layer in layers:
        q = torch.randn(num_tokens, num_heads * head_dim, generator=gen, dtype=DTYPE)
        k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen, dtype=DTYPE)
        v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen, dtype=DTYPE)
        out = backend.forward(q, k, v, layer, batch)
        assert out.shape == (num_tokens, num_heads * head_dim)
        # The new K/V went through set_kv_buffer.
        torch.testing.assert_close(pool.get_key_buffer(layer.layer_id)[out_cache_loc], k)
        torch.testing.assert_close(pool.get_value_buffer(layer.layer_id)[out_cache_loc], v)
        check_against_reference(
            pool, layer, rows, seq_lens, q, out, None if mode == "decode" else qo_indptr
        )


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("mode", ["decode", "extend", "mixed"])
@pytest.mark.parametrize("unshared", [False, True])
def test_shared_prefix_batch_equals_plain_attention(page_size: int, mode: str, unshared: bool):
    _run_case(page_size, mode, unshared=unshared)


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("mode", ["decode", "mixed"])
@pytest.mark.parametrize("hint", ["exact", "reversed"])
def test_hinted_plans_equal_plain_attention(page_size: int, mode: str, hint: str):
    _run_case(page_size, mode, hint=hint)


def test_step_options(monkeypatch: pytest.MonkeyPatch):
    """Both fast paths on by default; off through the constructor or the process defaults
    (:func:`prefixattn.engine.step.configure`, e.g. from a plugin in each scheduler)."""
    assert PrefixAttnBackend(_runner(1, 8, 2, 64, max_reqs=4)).planner.options == StepOptions()
    off = StepOptions(hinted_plans=False, unshared_plans=False)
    backend = PrefixAttnBackend(_runner(1, 8, 2, 64, max_reqs=4), options=off)
    assert backend.planner.options == off
    monkeypatch.setattr(step, "_defaults", StepOptions())  # restored after the test
    step.configure(hinted_plans=False)
    options = PrefixAttnBackend(_runner(1, 8, 2, 64, max_reqs=4)).planner.options
    assert options == StepOptions(hinted_plans=False)
    # Kernel-side options of the cores, the same way.
    step.configure(core_options={"split_waves": True})
    backend = PrefixAttnBackend(_runner(1, 8, 2, 64, max_reqs=4))
    assert backend.planner.eager_attention.split_waves is True


def test_cuda_without_kernels_is_refused(monkeypatch: pytest.MonkeyPatch):
    """No silent PyTorch-reference path on a GPU: the backend refuses to start, saying why."""
    monkeypatch.setattr(library, "cuda_ops_available", lambda: False)
    monkeypatch.setattr(library, "kernels_status", lambda: "not available: built CPU-only")
    runner = _runner(1, 8, 2, 64, max_reqs=2)
    runner.device = "cuda"  # refused before anything is allocated on it
    with pytest.raises(RuntimeError, match=r"compiled CUDA kernels are not available.*CPU-only"):
        PrefixAttnBackend(runner)


def test_refuses_the_metadata_glue_graph(monkeypatch: pytest.MonkeyPatch):
    """SGLang 0.5.19+ can capture init_forward_metadata_out_graph into a graph and replay only
    its device work: a host-built plan would then be replayed stale, so the backend refuses."""
    monkeypatch.setattr(sglang_backend, "metadata_glue_graph_enabled", lambda: True)
    with pytest.raises(ValueError, match=sglang_backend.GLUE_GRAPH_ENV):
        PrefixAttnBackend(_runner(1, 8, 2, 64, max_reqs=2))


def test_reads_sglang_glue_graph_switch(monkeypatch: pytest.MonkeyPatch):
    """The switch as SGLang itself reads it (from its environment registry)."""
    envs = pytest.importorskip("sglang.srt.environ").envs
    if getattr(envs, sglang_backend.GLUE_GRAPH_ENV, None) is None:
        assert not sglang_backend.metadata_glue_graph_enabled()  # SGLang < 0.5.19: none
        return
    monkeypatch.setenv(sglang_backend.GLUE_GRAPH_ENV, "1")
    assert sglang_backend.metadata_glue_graph_enabled()
    with pytest.raises(ValueError, match=f"Unset {sglang_backend.GLUE_GRAPH_ENV}"):
        PrefixAttnBackend(_runner(1, 8, 2, 64, max_reqs=2))
    monkeypatch.setenv(sglang_backend.GLUE_GRAPH_ENV, "0")
    assert not sglang_backend.metadata_glue_graph_enabled()


def test_mha_heads():
    _run_case(1, "decode", num_heads=4, num_kv_heads=4)


def test_refuses_sliding_window():
    runner = _runner(1, 4, 2, 64, max_reqs=2)
    backend = PrefixAttnBackend(runner)
    layer = RadixAttention(
        num_heads=4,
        head_dim=64,
        scaling=0.125,
        num_kv_heads=2,
        layer_id=0,
        sliding_window_size=8,
    )
    with pytest.raises(NotImplementedError, match="sliding window"):
        backend._check_layer(layer)


def test_refuses_non_causal_layers():
    # Encoder-only and bidirectional layers attend both ways; the plan is causal.
    from sglang.srt.layers.radix_attention import AttentionType

    backend = PrefixAttnBackend(_runner(1, 4, 2, 64, max_reqs=2))
    for kind in (AttentionType.ENCODER_ONLY, AttentionType.DECODER_BIDIRECTIONAL):
        layer = RadixAttention(
            num_heads=4, head_dim=64, scaling=0.125, num_kv_heads=2, layer_id=0, attn_type=kind
        )
        with pytest.raises(NotImplementedError, match=f"attention type {kind.value}"):
            backend._check_layer(layer)
    backend._check_layer(_layer(0, 4, 2, 64))  # a decoder layer is fine


def test_refuses_an_hnd_pool_speculative_and_diffusion_models():
    runner = _runner(4, 4, 2, 64, max_reqs=2)
    runner.token_to_kv_pool.kv_cache_layout = "hnd"  # what SGLANG_USE_HND_KVCACHE=1 sets
    with pytest.raises(ValueError, match="layout 'hnd' is not supported"):
        PrefixAttnBackend(runner)
    runner = _runner(4, 4, 2, 64, max_reqs=2)
    runner.spec_algorithm = SimpleNamespace(is_speculative=lambda: True)
    with pytest.raises(ValueError, match="speculative decoding"):
        PrefixAttnBackend(runner)
    runner = _runner(4, 4, 2, 64, max_reqs=2)
    runner.server_args = SimpleNamespace(dllm_algorithm="LowConfidence")
    with pytest.raises(ValueError, match="diffusion"):
        PrefixAttnBackend(runner)


def test_refuses_features_passed_as_arguments():
    backend = PrefixAttnBackend(_runner(1, 4, 2, 64, max_reqs=2))
    layer = _layer(0, 4, 2, 64)
    q = torch.zeros(1, 4 * 64)
    kv = torch.zeros(1, 2, 64)
    batch = SimpleNamespace(encoder_lens=None)
    with pytest.raises(NotImplementedError, match="passes sinks"):
        backend.forward_decode(q, kv, kv, layer, batch, sinks=torch.zeros(4))
    with pytest.raises(NotImplementedError, match="save_kv_cache=False"):
        backend.forward_extend(q, kv, kv, layer, batch, save_kv_cache=False)


def test_decode_beside_another_prefill_backend():
    """``--prefill-attention-backend torch_native --decode-attention-backend prefixattn``:
    SGLang's HybridAttnBackend sends an extend batch to torch_native, which writes the new
    K/V into the pool, and the next decode batch to prefixattn, which must read that K/V."""
    from sglang.srt.layers.attention.hybrid_attn_backend import HybridAttnBackend
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    num_heads, num_kv_heads, head_dim, page_size = 8, 2, 64, 1
    gen = torch.Generator().manual_seed(7)
    rows = _rows(TREE, page_size)
    bs = len(rows)
    runner = _runner(page_size, num_heads, num_kv_heads, head_dim, max_reqs=bs + 2)
    runner.server_args = SimpleNamespace(
        speculative_attention_mode="prefill", speculative_algorithm=None
    )
    runner.model_config.context_len = MAX_CONTEXT
    ours = PrefixAttnBackend(runner)
    from sglang.srt.runtime_context import get_context

    # SGLang >= 0.5.19 reads speculative settings from the published config, not
    # runner.server_args.
    with get_context().override_server_args(speculative_attention_mode="prefill"):
        hybrid = HybridAttnBackend(runner, TorchNativeAttnBackend(runner), ours)
    pool, req_to_token = runner.token_to_kv_pool, runner.req_to_token_pool.req_to_token
    layers = [_layer(lid, num_heads, num_kv_heads, head_dim) for lid in range(2)]

    # Cached prefixes in the pool; then an extend batch of 1-11 new tokens per request.
    new_lens = [min(len(r), n) for r, n in zip(rows, [1, 4, 2, 7, 1, 3, 5, 11], strict=True)]
    seq_lens = [len(r) for r in rows]
    prefix_lens = [s - n for s, n in zip(seq_lens, new_lens, strict=True)]
    for i, row in enumerate(rows):
        req_to_token[i + 1, : len(row)] = torch.tensor(row, dtype=torch.int32)
    cached = sorted({s for row, p in zip(rows, prefix_lens, strict=True) for s in row[:p]})
    loc = torch.tensor(cached, dtype=torch.int64)
    for layer in layers:
        k = torch.randn(len(cached), num_kv_heads, head_dim, generator=gen, dtype=DTYPE)
        pool.set_kv_buffer(layer, loc, k, torch.randn_like(k))

    def step(mode, new, lens):
        rows_now = [req_to_token[i + 1, :s].tolist() for i, s in enumerate(lens)]
        batch = _forward_batch(mode, rows_now, new)
        n = sum(new)
        hybrid.init_forward_metadata(batch)
        qo = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
        for layer in layers:
            q = torch.randn(n, num_heads * head_dim, generator=gen, dtype=DTYPE)
            k = torch.randn(n, num_kv_heads, head_dim, generator=gen, dtype=DTYPE)
            out = hybrid.forward(q, k, torch.randn_like(k), layer, batch)
            check_against_reference(pool, layer, rows_now, lens, q, out, qo)

    step(ForwardMode.EXTEND, new_lens, seq_lens)
    assert ours.forward_metadata is None  # the extend batch never reached prefixattn
    # Decode: one new slot per request, after everything allocated so far.
    first = max(max(r) for r in rows) + 1
    for i, s in enumerate(seq_lens):
        req_to_token[i + 1, s] = first + i
    step(ForwardMode.DECODE, [1] * bs, [s + 1 for s in seq_lens])
    assert ours.forward_metadata is not None and ours.forward_metadata.plan is not None


@pytest.mark.parametrize("page_size", [1, 4])
def test_decode_run_advances_plans(page_size: int, advances: dict[str, int]):
    # Decode steps of one batch, each request one token longer per step: after the step that
    # copies the rows and the first device-table step, each plan is the previous one advanced
    # (the device table keeps its shape across steps), and every output stays right.
    heads, kv_heads, head_dim = 8, 2, 64
    gen = torch.Generator().manual_seed(7)
    rows, backend, pool, req_to_token = _setup(page_size, heads, kv_heads, head_dim)
    bs = len(rows)
    layer = _layer(0, heads, kv_heads, head_dim)
    cached = sorted({s for row in rows for s in row})
    k = torch.randn(len(cached), kv_heads, head_dim, generator=gen, dtype=DTYPE)
    v = torch.randn(len(cached), kv_heads, head_dim, generator=gen, dtype=DTYPE)
    pool.set_kv_buffer(layer, torch.tensor(cached, dtype=torch.int64), k, v)
    next_page = max(cached) // page_size + 1
    steps = 6
    for _ in range(steps):
        for row in rows:  # one more slot per request: in its last page, else a new page
            if len(row) % page_size:
                row.append(row[-1] + 1)
            else:
                row.append(next_page * page_size)
                next_page += 1
        for i, row in enumerate(rows):
            req_to_token[i + 1, : len(row)] = torch.tensor(row, dtype=torch.int32)
        batch = _forward_batch(ForwardMode.DECODE, rows, [1] * bs)
        backend.init_forward_metadata(batch)
        q = torch.randn(bs, heads * head_dim, generator=gen, dtype=DTYPE)
        k = torch.randn(bs, kv_heads, head_dim, generator=gen, dtype=DTYPE)
        v = torch.randn(bs, kv_heads, head_dim, generator=gen, dtype=DTYPE)
        out = backend.forward(q, k, v, layer, batch)
        check_against_reference(pool, layer, rows, [len(r) for r in rows], q, out)
    assert backend.planner.plan_kinds["hinted"] == steps - 1
    # Two plans (the hinted one and its fallback) per step from the third step on: the run
    # keeps the hint of its first hinted step, though the rows copied then have landed.
    assert advances["advanced"] == 2 * (steps - 2) and advances["refused"] == 0


class _EngineBackend:
    """Stands in for SGLang's flashinfer backend (which needs a GPU) where the routing around
    it is tested: records the steps it was given; its output is all fives."""

    def __init__(self) -> None:
        self.steps: list[ForwardMode] = []
        self.calls: list[str] = []

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        self.steps.append(forward_batch.forward_mode)

    def _out(self, q: torch.Tensor, name: str) -> torch.Tensor:
        self.calls.append(name)
        return torch.full_like(q, 5.0)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        return self._out(q, "decode")

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        return self._out(q, "extend")


def test_unshared_eager_steps_run_on_sglangs_backend():
    """With flashinfer at hand (``delegate_backend``), an eager step the probe expects to
    share nothing goes to it, metadata and every layer's forward; the step still teaches,
    so the sharing it shows has the next step planned by prefixattn (and checked against
    plain attention). ``delegate_unshared=False`` keeps every step on prefixattn."""
    heads, kv_heads, head_dim = 8, 2, 64
    gen = torch.Generator().manual_seed(5)
    rows, backend, pool, req_to_token = _setup(1, heads, kv_heads, head_dim)
    assert backend.delegate_backend is None  # no flashinfer on a CPU device
    assert backend.planner.options.delegate_unshared is False  # the default
    backend.planner.options = StepOptions(delegate_unshared=True)
    fi = _EngineBackend()
    backend.delegate_backend = fi
    layer = _layer(0, heads, kv_heads, head_dim)
    cached = sorted({s for row in rows for s in row})
    k = torch.randn(len(cached), kv_heads, head_dim, generator=gen, dtype=DTYPE)
    pool.set_kv_buffer(layer, torch.tensor(cached, dtype=torch.int64), k, torch.randn_like(k))
    private = [rows[-1], rows[-2]]  # the request sharing nothing and the one on its own root
    for i, row in enumerate(private):
        req_to_token[i + 1, : len(row)] = torch.tensor(row, dtype=torch.int32)
    kinds = []
    for batch_rows in (private, private, rows, rows):
        for i, row in enumerate(batch_rows):
            req_to_token[i + 1, : len(row)] = torch.tensor(row, dtype=torch.int32)
        batch = _forward_batch(ForwardMode.DECODE, batch_rows, [1] * len(batch_rows))
        backend.init_forward_metadata(batch)
        q = torch.randn(len(batch_rows), heads * head_dim, generator=gen, dtype=DTYPE)
        k = torch.randn(len(batch_rows), kv_heads, head_dim, generator=gen, dtype=DTYPE)
        out = backend.forward(q, k, torch.randn_like(k), layer, batch)
        kinds.append("delegated" if backend.delegating else "prefixattn")
        if not backend.delegating:
            lens = [len(r) for r in batch_rows]
            check_against_reference(pool, layer, batch_rows, lens, q, out)
        else:
            assert torch.all(out == 5.0) and backend.forward_metadata is None
    # 1: nothing seen yet; 2: private seen; 3: delegated, shows sharing; 4: prefixattn again.
    assert kinds == ["prefixattn", "delegated", "delegated", "prefixattn"]
    assert fi.steps == [ForwardMode.DECODE] * 2 and fi.calls == ["decode"] * 2
    assert backend.planner.plan_kinds["delegated"] == 2

    off = PrefixAttnBackend(_runner(1, heads, kv_heads, head_dim, 4))
    off.planner.probe.observe(np.arange(3))  # a batch without sharing seen
    assert off.planner.choose(2, decode=True, delegate=True).kind == "unshared"


def test_no_flashinfer_steps_under_pdmux(caplog):
    """Prefill-decode multiplexing runs two attention backends at once, each with a flashinfer
    workspace of its own: no inner flashinfer backend there (it would share SGLang's)."""
    runner = SimpleNamespace(server_args=SimpleNamespace(enable_pdmux=True))
    with caplog.at_level("WARNING", logger="prefixattn"):
        assert sglang_backend.new_delegate_backend(runner) is None
    assert "--enable-pdmux" in caplog.text
