"""CUDA-graph support of the vLLM backend, on CPU tensors with vLLM's real classes.

- the support level the builder declares, and what vLLM's own mode resolution makes of it;
- a uniform decode batch padded the way vLLM pads it for a full CUDA graph (requests with no
  new token and length 0, block-table rows of zeros, tokens that belong to no request) gives
  plain attention for the real requests, and the plan covers every padded row;
- the capture batch, the reservation and the second planner for batches that are never
  replayed from a full graph;
- the error raised when a plan outgrows the buffers that captured graphs read.

Without a GPU, "graphs available" is simulated: ``PrefixAttention.cuda_graph_safe`` and
``prefixattn.runtime.library.cuda_ops_available`` are patched to True (the core then runs its PyTorch
reference on the CPU tensors), and a capture is simulated by patching the backend's
``_capturing``.
"""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("vllm")

import torch
from vllm.config import CompilationConfig, CUDAGraphMode, DeviceConfig, ModelConfig, VllmConfig
from vllm.config.compilation import CompilationMode
from vllm.v1.attention.backend import AttentionCGSupport, CommonAttentionMetadata
from vllm.v1.kv_cache_interface import FullAttentionSpec

from prefixattn import PrefixAttention, attention_reference
from prefixattn.adapters.vllm import backend as vllm_backend
from prefixattn.adapters.vllm.backend import (
    PrefixAttentionBackend,
    PrefixAttentionImpl,
    PrefixAttentionMetadataBuilder,
)
from prefixattn.runtime import library

NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM = 8, 2, 64
MAX_CAPTURE = 24  # vLLM's max_cudagraph_capture_size in the graph config below
NUM_BLOCKS = 1 + 300  # block 0 is vLLM's null block
GRAPH_DEPTH = vllm_backend.GRAPH_DEPTH_ALLOWANCE


def _config(
    tmp_path_factory: pytest.TempPathFactory, full_graphs: bool, max_capture: int = MAX_CAPTURE
) -> VllmConfig:
    model = tmp_path_factory.mktemp("llama")
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": NUM_QO_HEADS * HEAD_DIM, "intermediate_size": 1024,
        "num_attention_heads": NUM_QO_HEADS, "num_key_value_heads": NUM_KV_HEADS,
        "head_dim": HEAD_DIM, "num_hidden_layers": 2, "vocab_size": 1000,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16",
    }  # fmt: skip
    (model / "config.json").write_text(json.dumps(config))
    model_config = ModelConfig(model=str(model), dtype="bfloat16", skip_tokenizer_init=True)
    cfg = VllmConfig(model_config=model_config, device_config=DeviceConfig(device="cpu"))
    if full_graphs:
        # On a CPU vLLM resolves the mode to NONE; set what a GPU run has by default.
        cfg.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
        cfg.compilation_config.max_cudagraph_capture_size = max_capture
    return cfg


@pytest.fixture(scope="module")
def graph_config(tmp_path_factory: pytest.TempPathFactory) -> VllmConfig:
    return _config(tmp_path_factory, full_graphs=True)


@pytest.fixture(scope="module")
def big_graph_config(tmp_path_factory: pytest.TempPathFactory) -> VllmConfig:
    """vLLM's default largest graph (512 tokens), capped by max_num_seqs (128 here)."""
    return _config(tmp_path_factory, full_graphs=True, max_capture=512)


@pytest.fixture(scope="module")
def eager_config(tmp_path_factory: pytest.TempPathFactory) -> VllmConfig:
    return _config(tmp_path_factory, full_graphs=False)


@pytest.fixture
def graphs_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """A core that declares itself graph-safe, with its CUDA kernels loaded."""
    monkeypatch.setattr(PrefixAttention, "cuda_graph_safe", True, raising=False)
    monkeypatch.setattr(library, "cuda_ops_available", lambda: True)


def _spec(dtype: torch.dtype = torch.bfloat16, block_size: int = 16) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=block_size, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_DIM, dtype=dtype
    )


# --------------------------------------------------------------------- support level
@pytest.mark.parametrize(
    ("safe", "kernels", "dtype", "expected"),
    [
        (True, True, torch.bfloat16, AttentionCGSupport.UNIFORM_BATCH),
        (True, True, torch.float16, AttentionCGSupport.UNIFORM_BATCH),
        (False, True, torch.bfloat16, AttentionCGSupport.NEVER),  # core not graph-safe
        (True, False, torch.bfloat16, AttentionCGSupport.NEVER),  # kernels not built / no GPU
        (None, True, torch.bfloat16, AttentionCGSupport.NEVER),  # core without the attribute
        (True, True, torch.float32, AttentionCGSupport.NEVER),  # reference-only dtype
    ],
)
def test_declared_support_level(
    monkeypatch: pytest.MonkeyPatch,
    graph_config: VllmConfig,
    safe: bool | None,
    kernels: bool,
    dtype: torch.dtype,
    expected: AttentionCGSupport,
) -> None:
    if safe is None:
        monkeypatch.delattr(PrefixAttention, "cuda_graph_safe", raising=False)
    else:
        monkeypatch.setattr(PrefixAttention, "cuda_graph_safe", safe, raising=False)
    monkeypatch.setattr(library, "cuda_ops_available", lambda: kernels)
    got = PrefixAttentionMetadataBuilder.get_cudagraph_support(graph_config, _spec(dtype))
    assert got is expected


def test_support_level_on_this_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    # Even a graph-safe core reports NEVER where the CUDA kernels cannot run (this CPU host).
    monkeypatch.setattr(PrefixAttention, "cuda_graph_safe", True, raising=False)
    if library.cuda_ops_available():
        pytest.skip("CUDA kernels available here")
    got = PrefixAttentionMetadataBuilder.get_cudagraph_support(None, _spec())
    assert got is AttentionCGSupport.NEVER


@pytest.mark.parametrize("decode_query_len", [1, 3])
def test_vllm_keeps_full_decode_graphs_for_the_declared_level(decode_query_len: int) -> None:
    """vLLM's own resolution of its default mode: full decode graphs with UNIFORM_BATCH (also
    for speculative verification, query length 3), none with NEVER."""

    def resolve(level: AttentionCGSupport) -> CUDAGraphMode:
        cc = CompilationConfig(
            mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE
        )
        return cc.resolve_cudagraph_mode_and_sizes(level, "CUSTOM", decode_query_len)

    assert resolve(AttentionCGSupport.UNIFORM_BATCH) == CUDAGraphMode.FULL_AND_PIECEWISE
    assert resolve(AttentionCGSupport.NEVER).decode_mode() != CUDAGraphMode.FULL
    # The level below would lose full graphs for speculative verification.
    single = resolve(AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE).decode_mode()
    assert (single == CUDAGraphMode.FULL) == (decode_query_len == 1)


def test_no_graph_mode_without_full_graphs(graphs_on: None, eager_config: VllmConfig) -> None:
    builder = PrefixAttentionMetadataBuilder(_spec(), ["l0"], eager_config, torch.device("cpu"))
    assert not builder.full_graphs


# --------------------------------------------------------------------- batches
class Step:
    """Uniform batch: ``num_reqs`` requests of ``q_len`` new tokens over shared prefixes,
    padded like vLLM pads a full-graph batch."""

    def __init__(self, rng: torch.Generator, num_reqs: int, q_len: int, block_size: int = 16):
        self.block_size = block_size
        free = iter(torch.randperm(NUM_BLOCKS - 1, generator=rng).add(1).tolist())

        def rand(lo: int, hi: int) -> int:
            return int(torch.randint(lo, hi + 1, (1,), generator=rng))

        roots = [[next(free) for _ in range(rand(1, 3))] for _ in range(2)]
        nodes = [*roots, *[r + [next(free) for _ in range(rand(1, 2))] for r in roots], []]
        self.rows, lens = [], []
        for _ in range(num_reqs):
            prefix = nodes[rand(0, len(nodes) - 1)]
            tail = rand(q_len, 2 * block_size + 3)
            self.rows.append(prefix + [next(free) for _ in range(-(-tail // block_size))])
            lens.append(len(prefix) * block_size + tail)
        self.seq_lens = torch.tensor(lens, dtype=torch.int32)
        self.q_len = q_len
        self.num_reqs = num_reqs
        self.num_tokens = num_reqs * q_len

    def slots(self) -> list[int]:
        out = []
        bs = self.block_size
        for row, n in zip(self.rows, self.seq_lens.tolist(), strict=True):
            out += [row[p // bs] * bs + p % bs for p in range(n - self.q_len, n)]
        return out

    def metadata(
        self, pad_reqs: int = 0, pad_tokens: int = 0, host_lens: bool = True
    ) -> CommonAttentionMetadata:
        """vLLM's padding: ``pad_reqs`` requests with no new token (query_start_loc repeats
        the real total, seq_lens 0, block-table rows 0) and ``pad_tokens`` tokens past the
        last request (num_actual_tokens includes them, slot_mapping -1)."""
        b, n = self.num_reqs, self.num_tokens
        width = max(len(r) for r in self.rows) + 2
        table = torch.zeros(b + pad_reqs, width, dtype=torch.int32)
        for i, r in enumerate(self.rows):
            table[i, : len(r)] = torch.tensor(r, dtype=torch.int32)
        qsl = torch.full((b + pad_reqs + 1,), n, dtype=torch.int32)
        qsl[: b + 1] = torch.arange(b + 1, dtype=torch.int32) * self.q_len
        seq_lens = torch.cat([self.seq_lens, torch.zeros(pad_reqs, dtype=torch.int32)])
        slots = self.slots() + [-1] * pad_tokens
        return CommonAttentionMetadata(
            query_start_loc=qsl.clone(),
            query_start_loc_cpu=qsl,
            seq_lens=seq_lens.clone(),
            seq_lens_cpu_upper_bound=seq_lens.clone() if host_lens else None,
            num_reqs=b + pad_reqs,
            num_actual_tokens=n + pad_tokens,
            max_query_len=self.q_len,
            max_seq_len=int(self.seq_lens.max()),
            block_table_tensor=table,
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            causal=True,
        )

    def reference(self, query: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        width = max(len(r) for r in self.rows)
        table = torch.zeros(self.num_reqs, width, dtype=torch.int32)
        for i, r in enumerate(self.rows):
            table[i, : len(r)] = torch.tensor(r, dtype=torch.int32)
        qsl = torch.arange(self.num_reqs + 1, dtype=torch.int32) * self.q_len
        return attention_reference(
            query[: self.num_tokens].double(), k.double(), v.double(), table, self.seq_lens,
            qsl, scale=1.0 / math.sqrt(HEAD_DIM),
        )  # fmt: skip


def _cache(rng: torch.Generator, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    shape = PrefixAttentionBackend.get_kv_cache_shape(NUM_BLOCKS, 16, NUM_KV_HEADS, HEAD_DIM)
    order = PrefixAttentionBackend.get_kv_cache_stride_order()
    physical = torch.randn([shape[i] for i in order], generator=rng).to(dtype)
    return physical.permute(*[order.index(i) for i in range(4)])


def _forward(
    metadata: vllm_backend.PrefixAttentionMetadata, kv: torch.Tensor, rows: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs the impl on ``rows`` query rows (vLLM's padded token count); returns (q, out)."""
    g = torch.Generator().manual_seed(seed)
    impl = PrefixAttentionImpl(NUM_QO_HEADS, HEAD_DIM, 1.0 / math.sqrt(HEAD_DIM), NUM_KV_HEADS)
    query = torch.randn(rows, NUM_QO_HEADS, HEAD_DIM, generator=g).to(kv.dtype)
    out = torch.full_like(query, 7.0)
    impl.forward(None, query, query, query, kv, metadata, out)
    return query, out


def _check_real_rows(step: Step, query: torch.Tensor, out: torch.Tensor, kv: torch.Tensor) -> None:
    k_nhd = kv.transpose(1, 2)[..., :HEAD_DIM]
    v_nhd = kv.transpose(1, 2)[..., HEAD_DIM:]
    ref = step.reference(query, k_nhd, v_nhd)
    err = (out[: step.num_tokens].double() - ref).abs().max().item()
    assert err <= 3e-2, err  # bf16 output rounding is ~4e-3 at these magnitudes


# --------------------------------------------------------------------- padded batches
@pytest.mark.parametrize(
    ("num_reqs", "pad_reqs", "pad_tokens_per_req"),
    [
        (5, 3, 1),  # model runner V2 / V1 full-graph decode: 5 real requests in an 8-graph
        (13, 3, 1),
        (6, 0, 0),  # exactly a captured size: no padding
    ],
)
@pytest.mark.parametrize("seed", [0, 1])
def test_padded_uniform_decode_batch(
    graphs_on: None,
    graph_config: VllmConfig,
    num_reqs: int,
    pad_reqs: int,
    pad_tokens_per_req: int,
    seed: int,
) -> None:
    rng = torch.Generator().manual_seed(seed)
    step = Step(rng, num_reqs, q_len=1)
    builder = PrefixAttentionMetadataBuilder(_spec(), ["l0"], graph_config, torch.device("cpu"))
    assert builder.full_graphs
    pad_tokens = pad_reqs * pad_tokens_per_req
    cm = step.metadata(pad_reqs, pad_tokens)
    metadata = builder.build(0, cm)
    rows = cm.num_actual_tokens
    # The plan covers every row the captured graph reads, in the reserved buffers.
    assert metadata.plan.num_tokens == rows == metadata.num_tokens
    assert metadata.attention is builder.attention
    assert metadata.graph is builder.graph
    kv = _cache(rng)
    query, out = _forward(metadata, kv, rows, seed)
    _check_real_rows(step, query, out, kv)
    # Padding rows attend only to the null block's first slot: softmax over one key = its V.
    v_null = kv.transpose(1, 2)[0, 0, :, HEAD_DIM:]  # [Hkv, D]
    expected = v_null.repeat_interleave(NUM_QO_HEADS // NUM_KV_HEADS, dim=0)
    for row in range(step.num_tokens, rows):
        torch.testing.assert_close(out[row], expected)


def test_padding_tokens_without_padding_requests(graphs_on: None, graph_config: VllmConfig) -> None:
    """num_actual_tokens beyond the last request (no request padding): still planned."""
    rng = torch.Generator().manual_seed(3)
    step = Step(rng, 7, q_len=1)
    builder = PrefixAttentionMetadataBuilder(_spec(), ["l0"], graph_config, torch.device("cpu"))
    cm = step.metadata(pad_reqs=0, pad_tokens=5)
    metadata = builder.build(0, cm)
    assert metadata.plan.num_tokens == 12
    kv = _cache(rng)
    query, out = _forward(metadata, kv, 12)
    _check_real_rows(step, query, out, kv)
    assert torch.isfinite(out[7:].float()).all()


def test_padded_speculative_verification_batch(graphs_on: None, graph_config: VllmConfig) -> None:
    """Uniform batch of 3-token queries (1 + 2 speculative tokens), padded to 6 requests."""
    rng = torch.Generator().manual_seed(4)
    step = Step(rng, 4, q_len=3)
    builder = PrefixAttentionMetadataBuilder(_spec(), ["l0"], graph_config, torch.device("cpu"))
    builder.decode_query_len = 3  # what num_speculative_tokens=2 sets
    cm = step.metadata(pad_reqs=2, pad_tokens=6)
    metadata = builder.build(0, cm)
    assert metadata.graph is builder.graph
    assert metadata.plan.num_tokens == 18
    kv = _cache(rng)
    query, out = _forward(metadata, kv, 18)
    _check_real_rows(step, query, out, kv)


def test_device_seq_lens_not_read_when_host_copy_is_exact(
    graphs_on: None, graph_config: VllmConfig
) -> None:
    rng = torch.Generator().manual_seed(5)
    step = Step(rng, 6, q_len=1)
    builder = PrefixAttentionMetadataBuilder(_spec(), ["l0"], graph_config, torch.device("cpu"))
    cm = step.metadata(pad_reqs=2, pad_tokens=2)
    cm.seq_lens.fill_(-1)  # only seq_lens_cpu_upper_bound may be used
    kv = _cache(rng)
    query, out = _forward(builder.build(0, cm), kv, 8)
    _check_real_rows(step, query, out, kv)
    # Without a host copy the device lengths are used (and must be right).
    cm = step.metadata(pad_reqs=2, pad_tokens=2, host_lens=False)
    query, out = _forward(builder.build(0, cm), kv, 8)
    _check_real_rows(step, query, out, kv)


def test_padding_requests_dropped_without_full_graphs(eager_config: VllmConfig) -> None:
    """The same padded metadata with graphs off: real rows right, padding rows untouched."""
    rng = torch.Generator().manual_seed(6)
    step = Step(rng, 5, q_len=1)
    builder = PrefixAttentionMetadataBuilder(_spec(), ["l0"], eager_config, torch.device("cpu"))
    metadata = builder.build(0, step.metadata(pad_reqs=3, pad_tokens=3))
    assert metadata.plan.num_tokens == 5 and metadata.graph is None
    kv = _cache(rng)
    query, out = _forward(metadata, kv, 8)
    _check_real_rows(step, query, out, kv)
    assert torch.all(out[5:] == 7.0)


# --------------------------------------------------------------------- capture, reservation
def _capture_metadata(num_reqs: int, max_model_len: int) -> CommonAttentionMetadata:
    """vLLM's capture batch for a uniform decode graph: seq_len = query_len = 1, rows of the
    persistent (zeroed) block table, max_seq_len = max_model_len."""
    qsl = torch.arange(num_reqs + 1, dtype=torch.int32)
    ones = torch.ones(num_reqs, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl.clone(), query_start_loc_cpu=qsl, seq_lens=ones.clone(),
        seq_lens_cpu_upper_bound=ones, num_reqs=num_reqs, num_actual_tokens=num_reqs,
        max_query_len=1, max_seq_len=max_model_len,
        block_table_tensor=torch.zeros(num_reqs, max_model_len // 16, dtype=torch.int32),
        slot_mapping=torch.full((num_reqs,), -1, dtype=torch.int64), causal=True,
    )  # fmt: skip


def test_capture_batch_goes_to_reserved_buffers(graphs_on: None, graph_config: VllmConfig) -> None:
    builder = PrefixAttentionMetadataBuilder(_spec(), ["l0"], graph_config, torch.device("cpu"))
    metadata = builder.build_for_cudagraph_capture(_capture_metadata(8, 4096))
    assert metadata.graph is builder.graph and metadata.attention is builder.attention
    assert metadata.plan.num_tokens == 8


@pytest.mark.parametrize("slots_per_token", [None, 16])
def test_reservation_for_largest_captured_batch(
    graphs_on: None,
    graph_config: VllmConfig,
    monkeypatch: pytest.MonkeyPatch,
    slots_per_token: int | None,
) -> None:
    calls: list[dict] = []
    monkeypatch.setattr(PrefixAttention, "reserve", lambda self, **kw: calls.append(kw))
    if slots_per_token is not None:  # vLLM's own config carries the option to every worker
        options = {vllm_backend.OPTIONS_KEY: {"graph_slots_per_token": slots_per_token}}
        monkeypatch.setattr(graph_config, "additional_config", options)
    builder = PrefixAttentionMetadataBuilder(_spec(), ["l0"], graph_config, torch.device("cpu"))
    t = min(MAX_CAPTURE, graph_config.scheduler_config.max_num_seqs)
    assert builder.max_graph_tokens == t
    max_len = graph_config.model_config.max_model_len  # 4096
    # 16 prefix levels + split parts of at least 256 tokens (16 of them, +1), unless overridden.
    factor = slots_per_token or 16 + min(2 * t, -(-max_len // 256)) + 1
    assert builder.slots_per_token == factor
    # Spare slots for small batches cut at the leaf floor (StepPlanner.spare_slots).
    spare = builder.planner.spare_slots()
    assert spare >= 1024
    slots = factor * t + spare
    assert calls == [
        {
            "num_work_items": slots,
            "num_pages": t * (max_len // 16 + 1) + slots,
            "num_slots": slots,
            "num_tokens": t,
            "hinted": True,  # the fallback of hinted plans is launched by the graphs too
        }
    ]


def test_reservation_holds_deep_and_long_decode_batches(
    graphs_on: None, big_graph_config: VllmConfig
) -> None:
    """Plans of the largest graph batch stay within the reservation: a long shared prefix cut
    into many split parts (17 slots per token) and a 16-level chain of shared prefixes."""
    cfg = big_graph_config
    builder = PrefixAttentionMetadataBuilder(_spec(), ["l0"], cfg, torch.device("cpu"))
    t, bs = builder.max_graph_tokens, 16
    assert t == cfg.scheduler_config.max_num_seqs
    slots = builder.slots_per_token * t + builder.planner.spare_slots()
    pages = t * (cfg.model_config.max_model_len // bs + 1) + slots
    long_prefix = list(range(1, 4000 // bs + 1))  # ~4K tokens shared by all
    levels = [list(range(1000 + 100 * d, 1000 + 100 * d + 15)) for d in range(GRAPH_DEPTH)]
    for rows in (
        [[*long_prefix, 2000 + i] for i in range(t)],
        # request i shares the first i % 16 + 1 levels (240 tokens each) of one chain
        [[b for lvl in levels[: i % GRAPH_DEPTH + 1] for b in lvl] + [3000 + i] for i in range(t)],
    ):
        width = max(map(len, rows))
        table = torch.zeros(t, width, dtype=torch.int32)
        for i, r in enumerate(rows):
            table[i, : len(r)] = torch.tensor(r, dtype=torch.int32)
        lens = torch.tensor([len(r) * bs - 3 for r in rows], dtype=torch.int32)
        qsl = torch.arange(t + 1, dtype=torch.int32)
        cm = CommonAttentionMetadata(
            query_start_loc=qsl.clone(), query_start_loc_cpu=qsl, seq_lens=lens.clone(),
            seq_lens_cpu_upper_bound=lens, num_reqs=t, num_actual_tokens=t, max_query_len=1,
            max_seq_len=int(lens.max()), block_table_tensor=table,
            slot_mapping=torch.zeros(t, dtype=torch.int64), causal=True,
        )  # fmt: skip
        metadata = builder.build(0, cm)
        assert metadata.graph is builder.graph
        plan = metadata.plan
        assert plan.num_work_items <= slots
        assert len(plan.q_tokens) <= slots and plan.num_partials <= slots
        assert len(plan.kv_pages) <= pages


def test_no_reservation_without_graphs(
    graph_config: VllmConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[dict] = []
    monkeypatch.setattr(PrefixAttention, "reserve", lambda self, **kw: calls.append(kw))
    builder = PrefixAttentionMetadataBuilder(_spec(), ["l0"], graph_config, torch.device("cpu"))
    assert not builder.full_graphs and calls == []


def test_batches_never_replayed_use_the_second_planner(
    graphs_on: None, graph_config: VllmConfig
) -> None:
    rng = torch.Generator().manual_seed(7)
    builder = PrefixAttentionMetadataBuilder(_spec(), ["l0"], graph_config, torch.device("cpu"))
    prefill = Step(rng, 3, q_len=4)  # 4-token chunks: not a decode batch
    metadata = builder.build(0, prefill.metadata(pad_tokens=2))
    assert metadata.attention is not builder.attention and metadata.graph is None
    assert metadata.plan.num_tokens == 12  # no padding planned: vLLM never replays it
    kv = _cache(rng)
    query, out = _forward(metadata, kv, 14)
    _check_real_rows(prefill, query, out, kv)
    assert torch.all(out[12:] == 7.0)
    big = Step(rng, MAX_CAPTURE + 1, q_len=1)  # more tokens than the largest graph
    assert builder.build(0, big.metadata()).graph is None


# --------------------------------------------------------------------- stale buffers
def _capture(builder: PrefixAttentionMetadataBuilder, monkeypatch: pytest.MonkeyPatch) -> None:
    """What vLLM's capture does: build the capture batch, run forward while capturing."""
    metadata = builder.build_for_cudagraph_capture(_capture_metadata(8, 4096))
    with monkeypatch.context() as m:
        m.setattr(vllm_backend, "_capturing", lambda t: True)
        _forward(metadata, _cache(torch.Generator().manual_seed(0)), 8)


def _builder_with_generation(
    graph_config: VllmConfig, monkeypatch: pytest.MonkeyPatch, start: int
) -> tuple[PrefixAttentionMetadataBuilder, list[int]]:
    """A builder whose cores report ``generation[0]`` as their buffers' generation."""
    builder = PrefixAttentionMetadataBuilder(_spec(), ["l0"], graph_config, torch.device("cpu"))
    generation = [start]
    monkeypatch.setattr(PrefixAttention, "buffers_generation", property(lambda s: generation[0]))
    return builder, generation


def test_stale_graph_buffers_raise(
    graphs_on: None, graph_config: VllmConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = torch.Generator().manual_seed(8)
    builder, generation = _builder_with_generation(graph_config, monkeypatch, 3)
    _capture(builder, monkeypatch)
    assert builder.graph.captured_generation == 3
    decode = Step(rng, 5, q_len=1)
    builder.build(0, decode.metadata(pad_reqs=3, pad_tokens=3))  # same buffers: fine
    generation[0] = 4  # a plan made the buffers grow
    with pytest.raises(RuntimeError, match="outgrew the buffers reserved") as err:
        builder.build(0, decode.metadata(pad_reqs=3, pad_tokens=3))
    message = str(err.value)
    assert "enforce_eager" in message and "PIECEWISE" in message
    assert "graph_slots_per_token" in message
    # Batches that are never replayed from a full graph do not depend on those buffers.
    builder.build(0, Step(rng, 3, q_len=4).metadata())


def test_growth_between_captures_raises(
    graphs_on: None, graph_config: VllmConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    builder, generation = _builder_with_generation(graph_config, monkeypatch, 0)
    _capture(builder, monkeypatch)
    _capture(builder, monkeypatch)  # unchanged: fine
    generation[0] = 1
    with pytest.raises(RuntimeError, match="between two CUDA graph captures"):
        _capture(builder, monkeypatch)


def test_no_check_before_capture(
    graphs_on: None, graph_config: VllmConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = torch.Generator().manual_seed(9)
    builder, generation = _builder_with_generation(graph_config, monkeypatch, 0)
    builder.build(0, Step(rng, 5, q_len=1).metadata())
    generation[0] = 1  # growth before any graph exists is harmless
    step = Step(rng, 5, q_len=1)
    metadata = builder.build(0, step.metadata())
    assert builder.graph.captured_generation is None  # nothing captured, nothing checked
    assert metadata.graph is builder.graph and metadata.attention is builder.attention
    assert metadata.plan is builder.attention.last_plan and metadata.plan.num_tokens == 5
    kv = _cache(rng)
    query, out = _forward(metadata, kv, 5)
    _check_real_rows(step, query, out, kv)


def test_capturing_a_batch_outside_the_reserved_buffers_raises(
    graphs_on: None, graph_config: VllmConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = torch.Generator().manual_seed(10)
    builder = PrefixAttentionMetadataBuilder(_spec(), ["l0"], graph_config, torch.device("cpu"))
    metadata = builder.build(0, Step(rng, 3, q_len=4).metadata())  # second planner
    monkeypatch.setattr(vllm_backend, "_capturing", lambda t: True)
    with pytest.raises(RuntimeError, match="not graph-eligible"):
        _forward(metadata, _cache(rng), 12)
