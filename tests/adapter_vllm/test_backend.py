"""The real vLLM (0.26 through 0.33) metadata -> the backend's builder -> impl.forward, on CPU tensors.

Every batch is checked against plain causal attention (the core's ``attention_reference``) on
the same paged cache. Batches are random forests of shared prefixes (prefix caching gives
requests with a common prefix identical leading block ids) mixing decodes (1 query token),
speculative verification (2-5 tokens) and prefill/extend chunks (longer, up to a whole prompt).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math

import numpy as np
import pytest

pytest.importorskip("vllm")

import torch
from vllm.config import DeviceConfig, ModelConfig, VllmConfig
from vllm.platforms.interface import DeviceCapability
from vllm.v1.attention.backend import AttentionType, CommonAttentionMetadata
from vllm.v1.kv_cache_interface import FullAttentionSpec

from prefixattn import LaunchPlan, attention_reference
from prefixattn.adapters.vllm import backend as vllm_backend
from prefixattn.adapters.vllm.backend import (
    PrefixAttentionBackend,
    PrefixAttentionImpl,
    PrefixAttentionMetadataBuilder,
)
from prefixattn.runtime import library

NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM = 8, 2, 64


def _spec(dtype: torch.dtype = torch.float32, block_size: int = 16) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=block_size, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_DIM, dtype=dtype
    )


@pytest.fixture(scope="module")
def vllm_config(tmp_path_factory: pytest.TempPathFactory) -> VllmConfig:
    """A real VllmConfig for a small Llama described by a local config.json (no weights)."""
    model = tmp_path_factory.mktemp("llama")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": NUM_QO_HEADS * HEAD_DIM,
        "intermediate_size": 1024,
        "num_attention_heads": NUM_QO_HEADS,
        "num_key_value_heads": NUM_KV_HEADS,
        "head_dim": HEAD_DIM,
        "num_hidden_layers": 2,
        "vocab_size": 1000,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "torch_dtype": "float32",
    }
    (model / "config.json").write_text(json.dumps(config))
    model_config = ModelConfig(model=str(model), dtype="float32", skip_tokenizer_init=True)
    # With no GPU vLLM's platform is "unspecified"; naming the device explicitly is enough here
    # (the builder reads only the model's head counts).
    return VllmConfig(model_config=model_config, device_config=DeviceConfig(device="cpu"))


class Batch:
    """A random step: shared-prefix block tables, lengths and the vLLM metadata for them."""

    def __init__(self, rng: torch.Generator, block_size: int, num_reqs: int, mixed: bool) -> None:
        self.block_size = block_size
        num_blocks = 1 + 200  # block 0 is vLLM's null block; never referenced by a real row
        free = iter(torch.randperm(num_blocks - 1, generator=rng).add(1).tolist())

        def rand(lo: int, hi: int) -> int:
            return int(torch.randint(lo, hi + 1, (1,), generator=rng))

        # Two-level forest: a few roots, each with a few children; each request picks a node
        # and appends private blocks.
        roots = [[next(free) for _ in range(rand(1, 4))] for _ in range(rand(1, 3))]
        nodes = [r for r in roots] + [
            r + [next(free) for _ in range(rand(1, 3))] for r in roots for _ in range(rand(0, 2))
        ]
        nodes.append([])  # requests that share nothing
        rows, seq_lens, q_lens = [], [], []
        for _ in range(num_reqs):
            prefix = nodes[rand(0, len(nodes) - 1)]
            tail = rand(1, 2 * block_size + 3)  # private tokens incl. a partial last block
            seq_len = len(prefix) * block_size + tail
            row = prefix + [next(free) for _ in range(math.ceil(tail / block_size))]
            if not mixed:
                q_len = 1
            else:
                # decode; speculative verification; prefill/extend chunk. New tokens go to the
                # request's own blocks only (cached prefix blocks are full and never rewritten);
                # with no shared prefix a chunk may be the whole prompt.
                kind = rand(0, 2)
                q_len = (1, rand(1, min(5, tail)), rand(1, tail))[kind]
            rows.append(row)
            seq_lens.append(seq_len)
            q_lens.append(q_len)
        width = max(len(r) for r in rows) + 2  # vLLM's table is wider than needed; pad with 0
        self.block_table = torch.zeros(num_reqs, width, dtype=torch.int32)
        for i, r in enumerate(rows):
            self.block_table[i, : len(r)] = torch.tensor(r, dtype=torch.int32)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
        q_lens_t = torch.tensor(q_lens, dtype=torch.int32)
        self.qo_indptr = torch.zeros(num_reqs + 1, dtype=torch.int32)
        self.qo_indptr[1:] = torch.cumsum(q_lens_t, 0)
        self.num_blocks = num_blocks
        n = int(self.qo_indptr[-1])
        slots = []
        for i in range(num_reqs):
            for pos in range(seq_lens[i] - q_lens[i], seq_lens[i]):
                slots.append(rows[i][pos // block_size] * block_size + pos % block_size)
        self.slot_mapping = torch.tensor(slots, dtype=torch.int64)
        self.num_tokens = n

    def metadata(self, pad: int = 0, host_lens: bool = False) -> CommonAttentionMetadata:
        q_lens = self.qo_indptr[1:] - self.qo_indptr[:-1]
        slot_mapping = torch.cat([self.slot_mapping, torch.full((pad,), -1, dtype=torch.int64)])
        return CommonAttentionMetadata(
            query_start_loc=self.qo_indptr.clone(),
            query_start_loc_cpu=self.qo_indptr.clone(),
            seq_lens=self.seq_lens.clone(),
            num_reqs=self.seq_lens.shape[0],
            num_actual_tokens=self.num_tokens + pad,
            max_query_len=int(q_lens.max()),
            max_seq_len=int(self.seq_lens.max()),
            block_table_tensor=self.block_table.clone(),
            slot_mapping=slot_mapping,
            causal=True,
            seq_lens_cpu_upper_bound=self.seq_lens.clone() if host_lens else None,
        )


class _Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self._k_scale = torch.tensor(1.0)
        self._v_scale = torch.tensor(1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("block_size", "num_reqs", "mixed", "pad"),
    [
        (16, 9, False, 0),  # vLLM's default block size, decode only
        (16, 13, True, 0),  # mixed decode / spec verification / prefill chunks
        (16, 7, True, 5),  # padded token count (num_actual_tokens > real tokens)
        (16, 7, False, 3),  # decode with padding (hinted plans: padding planned private)
        (1, 6, True, 0),  # one token per block: every shared token is its own block
        (32, 11, True, 0),
    ],
)
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("mode", ["copy", "unshared", "hinted", "stale_hint"])
def test_builder_and_forward_match_plain_attention(
    vllm_config: VllmConfig,
    dtype: torch.dtype,
    block_size: int,
    num_reqs: int,
    mixed: bool,
    pad: int,
    seed: int,
    mode: str,
) -> None:
    """``unshared``: the builder's last look found no sharing, so this step (whose requests do
    share blocks) is planned without a host copy of the table. ``hinted`` / ``stale_hint``: a
    step planned from an earlier host copy of the table, right or wrong (then its
    device check switches to the per-request fallback). The result is the same."""
    rng = torch.Generator().manual_seed(seed * 1000 + block_size * 10 + num_reqs)
    batch = Batch(rng, block_size, num_reqs, mixed)
    # A hint is used for decode and mixed steps alike (none of these is a graph step).
    hinted = mode in ("hinted", "stale_hint")
    builder = PrefixAttentionMetadataBuilder(
        _spec(dtype, block_size), ["layer.0"], vllm_config, torch.device("cpu")
    )
    if mode == "unshared":
        builder.planner.probe.observe(np.arange(3))
    if mode in ("hinted", "stale_hint"):
        hint = batch.block_table.numpy()
        if mode == "stale_hint":
            hint = hint[::-1].copy()  # rows in another order
        builder.planner.table_hint.observe(hint, batch.seq_lens.numpy(), block_size)
    metadata = builder.build(
        common_prefix_len=0, common_attn_metadata=batch.metadata(pad, host_lens=mode != "copy")
    )
    assert (metadata.plan.max_page_id == -1) == (mode == "unshared" or hinted)
    assert metadata.plan.packing == ("per_query" if mode == "unshared" else "memory")
    assert (metadata.plan.fallback is not None) == hinted

    shape = PrefixAttentionBackend.get_kv_cache_shape(
        batch.num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM
    )
    order = PrefixAttentionBackend.get_kv_cache_stride_order()
    # Allocate in memory order and permute back to the logical shape, as vLLM does.
    physical = torch.randn([shape[i] for i in order], generator=rng).to(dtype)
    kv_cache = physical.permute(*[order.index(i) for i in range(4)])
    assert tuple(kv_cache.shape) == shape

    scale = 1.0 / math.sqrt(HEAD_DIM)
    impl = PrefixAttentionImpl(NUM_QO_HEADS, HEAD_DIM, scale, NUM_KV_HEADS)
    t = batch.num_tokens + pad
    query = torch.randn(t, NUM_QO_HEADS, HEAD_DIM, generator=rng).to(dtype)
    key = torch.randn(t, NUM_KV_HEADS, HEAD_DIM, generator=rng).to(dtype)
    value = torch.randn(t, NUM_KV_HEADS, HEAD_DIM, generator=rng).to(dtype)
    layer = _Layer()
    impl.do_kv_cache_update(layer, key, value, kv_cache, batch.metadata(pad).slot_mapping)

    # The new tokens' K/V are where slot_mapping says.
    k_nhd = kv_cache.transpose(1, 2)[..., :HEAD_DIM]
    v_nhd = kv_cache.transpose(1, 2)[..., HEAD_DIM:]
    s = batch.slot_mapping
    torch.testing.assert_close(k_nhd[s // block_size, s % block_size], key[: batch.num_tokens])
    torch.testing.assert_close(v_nhd[s // block_size, s % block_size], value[: batch.num_tokens])

    output = torch.full((t, NUM_QO_HEADS, HEAD_DIM), 7.0, dtype=dtype)
    impl.forward(layer, query, key, value, kv_cache, metadata, output)

    n = batch.num_tokens
    ref64 = attention_reference(
        query[:n].double(), k_nhd.double(), v_nhd.double(), batch.block_table,
        batch.seq_lens, batch.qo_indptr, scale=scale,
    )  # fmt: skip
    # Bound: a small multiple of the error plain attention itself makes in this dtype.
    ref_low = attention_reference(
        query[:n], k_nhd, v_nhd, batch.block_table, batch.seq_lens, batch.qo_indptr,
        scale=scale, compute_dtype=torch.float32,
    ).to(dtype)  # fmt: skip
    base_err = (ref_low.double() - ref64).abs().max().item()
    err = (output[:n].double() - ref64).abs().max().item()
    eps = torch.finfo(dtype).eps
    assert err <= 4 * base_err + 4 * eps, (err, base_err)
    # Padding rows are left alone.
    assert torch.all(output[n:] == 7.0)


def test_profiling_run_without_metadata(vllm_config: VllmConfig) -> None:
    impl = PrefixAttentionImpl(NUM_QO_HEADS, HEAD_DIM, 0.125, NUM_KV_HEADS)
    q = torch.randn(4, NUM_QO_HEADS, HEAD_DIM)
    out = torch.full_like(q, 3.0)
    kv = torch.zeros(PrefixAttentionBackend.get_kv_cache_shape(2, 16, NUM_KV_HEADS, HEAD_DIM))
    assert impl.forward(_Layer(), q, q, q, kv, None, out) is out
    assert torch.all(out == 0)


def _options(monkeypatch: pytest.MonkeyPatch, config: VllmConfig, **options: object) -> None:
    """StepOptions the way a vLLM user passes them: ``additional_config={"prefixattn": ...}``."""
    monkeypatch.setattr(config, "additional_config", {vllm_backend.OPTIONS_KEY: options})


def test_core_options_from_additional_config(
    vllm_config: VllmConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Kernel-side options reach the cores: ``{"prefixattn": {"core_options": {...}}}``."""
    _options(monkeypatch, vllm_config, core_options={"split_waves": True})
    builder = PrefixAttentionMetadataBuilder(_spec(), ["l"], vllm_config, torch.device("cpu"))
    assert builder.planner.eager_attention.split_waves is True
    _options(monkeypatch, vllm_config, core_options={"no_such_option": 1})
    with pytest.raises(AttributeError, match="no_such_option"):
        PrefixAttentionMetadataBuilder(_spec(), ["l"], vllm_config, torch.device("cpu"))


def test_plans_follow_the_sharing_seen(
    vllm_config: VllmConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step after one without shared blocks is planned from lengths alone; a step that then
    shows sharing switches the next one back to the prefix-aware plan."""
    _options(monkeypatch, vllm_config, hinted_plans=False)  # copies only (hinted plans: below)
    rng = torch.Generator().manual_seed(11)
    shared = Batch(rng, 16, 8, False)
    # The same requests' lengths on other first blocks: the hint's rows seem to continue,
    # but their pages differ (as when an evicted prefix was computed again).
    private = copy.deepcopy(shared)
    private.block_table[:, 0] = torch.arange(100, 108, dtype=torch.int32)  # no common block
    builder = PrefixAttentionMetadataBuilder(_spec(), ["l"], vllm_config, torch.device("cpu"))
    assert builder.planner.options.hinted_plans is False
    kinds = []
    for batch in (private, private, shared, shared, private, private):
        plan = builder.build(0, batch.metadata(host_lens=True)).plan
        kinds.append(plan.packing)
    # first step: nothing seen yet; the 3rd is planned unshared but shows sharing (4th: memory)
    assert kinds == ["memory", "per_query", "per_query", "memory", "memory", "per_query"]
    # Without host lengths (speculative decoding) or with the switch off: always copied.
    assert builder.build(0, private.metadata()).plan.packing == "memory"
    _options(monkeypatch, vllm_config, hinted_plans=False, unshared_plans=False)
    off = PrefixAttentionMetadataBuilder(_spec(), ["l"], vllm_config, torch.device("cpu"))
    for _ in range(2):
        assert off.build(0, private.metadata(host_lens=True)).plan.packing == "memory"


def _kind(plan: LaunchPlan) -> str:
    if plan.fallback is None:
        return "copy" if plan.max_page_id >= 0 else "unshared"
    return "hinted-fallback" if bool(plan.fallback_taken) else "hinted"


def test_steps_with_sharing_are_planned_from_an_earlier_table(
    vllm_config: VllmConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode steps with sharing take their forest from an earlier step's copy of the table
    (no wait for this step's); a wrong one is caught by the check, and the next step's hint
    is this step's table."""
    rng = torch.Generator().manual_seed(11)
    shared = Batch(rng, 16, 8, False)
    # The same requests' lengths on other first blocks: the hint's rows seem to continue,
    # but their pages differ (as when an evicted prefix was computed again).
    private = copy.deepcopy(shared)
    private.block_table[:, 0] = torch.arange(100, 108, dtype=torch.int32)  # no common block
    builder = PrefixAttentionMetadataBuilder(_spec(), ["l"], vllm_config, torch.device("cpu"))
    kinds = [
        _kind(builder.build(0, batch.metadata(host_lens=True)).plan)
        for batch in (shared, shared, private, private, shared, shared, private)
    ]
    # 1: no hint yet (copy); 2: hint from 1; 3: hint of the shared table (caught); 4: no
    # sharing seen; 5: unshared, shows sharing; 6: hint from 5's table; 7: hint caught.
    assert kinds == [
        "copy", "hinted", "hinted-fallback", "unshared", "unshared", "hinted", "hinted-fallback"
    ]  # fmt: skip
    assert builder.plan_kinds == {"copy": 1, "unshared": 2, "hinted": 4, "delegated": 0}
    _options(monkeypatch, vllm_config, hinted_plans=False)
    off = PrefixAttentionMetadataBuilder(_spec(), ["l"], vllm_config, torch.device("cpu"))
    kinds = [_kind(off.build(0, shared.metadata(host_lens=True)).plan) for _ in range(3)]
    assert kinds == ["copy"] * 3


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"hinted_plans": "no"}, TypeError),
        ({"graph_slots_per_token": 0}, ValueError),
        ({"no_such_option": True}, AttributeError),
    ],
)
def test_wrong_options_are_refused_at_construction(
    vllm_config: VllmConfig, monkeypatch: pytest.MonkeyPatch, options: dict, error: type
) -> None:
    _options(monkeypatch, vllm_config, **options)
    with pytest.raises(error, match="StepOptions"):
        PrefixAttentionMetadataBuilder(_spec(), ["l"], vllm_config, torch.device("cpu"))


def test_one_plan_per_step_shared_by_layers(vllm_config: VllmConfig) -> None:
    rng = torch.Generator().manual_seed(5)
    batch = Batch(rng, 16, 8, True)
    builder = PrefixAttentionMetadataBuilder(
        _spec(), ["layer.0", "layer.1"], vllm_config, torch.device("cpu")
    )
    metadata = builder.build(0, batch.metadata())
    assert metadata.plan is builder.attention.last_plan
    assert metadata.num_tokens == batch.num_tokens


CAP = DeviceCapability(9, 0)


def _reasons(**overrides: object) -> list[str]:
    args: dict[str, object] = dict(
        head_size=128, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=16,
        use_mla=False, has_sink=False, use_sparse=False, use_mm_prefix=False,
        use_per_head_quant_scales=False, device_capability=CAP,
        attn_type=AttentionType.DECODER,
    )  # fmt: skip
    args.update(overrides)
    return PrefixAttentionBackend.validate_configuration(**args)


@pytest.fixture
def kernels_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled CUDA kernels, as on a GPU machine with a CUDA build."""
    monkeypatch.setattr(library, "cuda_ops_available", lambda: True)


def test_validate_configuration_accepts_supported(kernels_loaded: None) -> None:
    for head_size in (64, 128, 256):
        for dtype in (torch.float16, torch.bfloat16):
            for block_size in (1, 16, 32, 64, 128):
                assert _reasons(head_size=head_size, dtype=dtype, block_size=block_size) == []


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"head_size": 80}, "head_size not supported"),
        ({"dtype": torch.float32}, "dtype not supported"),
        ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype not supported"),
        ({"block_size": 256}, "block_size not supported"),
        ({"use_mla": True}, "MLA not supported"),
        ({"has_sink": True}, "attention sinks not supported"),
        ({"has_sliding_window": True}, "sliding window not supported"),
        ({"attn_type": AttentionType.ENCODER_ONLY}, "attention type"),
        ({"use_non_causal": True}, "non-causal attention not supported"),
        ({"use_mm_prefix": True}, "bidirectional multimodal prefixes not supported"),
        ({"kv_cache_dtype": "float16"}, "differs from the model dtype"),
    ],
)
def test_validate_configuration_reports_unsupported(overrides: dict, reason: str) -> None:
    reasons = _reasons(**overrides)
    assert any(reason in r for r in reasons), reasons


def test_impl_refuses_unsupported_features() -> None:
    with pytest.raises(NotImplementedError, match="sliding window"):
        PrefixAttentionImpl(8, 128, 0.1, 2, sliding_window=128)
    with pytest.raises(NotImplementedError, match="ALiBi"):
        PrefixAttentionImpl(8, 128, 0.1, 2, alibi_slopes=[0.1] * 8)


def test_compute_capability(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(library, "cuda_ops_available", lambda: True)  # kernels for sm_90a
    assert _reasons() == []
    assert any(
        "compute capability" in r for r in _reasons(device_capability=DeviceCapability(8, 0))
    )


def test_cuda_without_kernels_is_refused(
    vllm_config: VllmConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No silent PyTorch-reference path on a GPU: vLLM is told why at backend selection, and
    the builder and impl refuse to be built if reached anyway."""
    monkeypatch.setattr(library, "cuda_ops_available", lambda: False)
    monkeypatch.setattr(library, "kernels_status", lambda: "not available: built CPU-only")
    expected = "built CPU-only"
    for cap in (CAP, DeviceCapability(8, 0)):
        reasons = _reasons(device_capability=cap)
        assert len(reasons) == 1 and "compiled CUDA kernels are not available" in reasons[0]
        assert expected in reasons[0]
    with pytest.raises(RuntimeError, match=expected):
        PrefixAttentionMetadataBuilder(_spec(), ["l0"], vllm_config, torch.device("cuda"))
    monkeypatch.setattr(vllm_backend, "_engine_on_cuda", lambda: True)
    with pytest.raises(RuntimeError, match=expected):
        PrefixAttentionImpl(NUM_QO_HEADS, HEAD_DIM, 0.125, NUM_KV_HEADS)
    # A CPU engine runs the reference, as it always has.
    monkeypatch.setattr(vllm_backend, "_engine_on_cuda", lambda: False)
    PrefixAttentionImpl(NUM_QO_HEADS, HEAD_DIM, 0.125, NUM_KV_HEADS)
    PrefixAttentionMetadataBuilder(_spec(), ["l0"], vllm_config, torch.device("cpu"))


def test_builder_takes_its_layers_head_count(
    vllm_config: VllmConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A group whose layers have another head count than the model (a draft model's).
    monkeypatch.setattr(vllm_backend, "get_num_attention_heads_from_layers", lambda c, n: 16)
    builder = PrefixAttentionMetadataBuilder(_spec(), ["draft.0"], vllm_config, torch.device("cpu"))
    assert builder.num_qo_heads == 16
    monkeypatch.setattr(vllm_backend, "get_num_attention_heads_from_layers", lambda c, n: None)
    builder = PrefixAttentionMetadataBuilder(_spec(), ["layer.0"], vllm_config, torch.device("cpu"))
    assert builder.num_qo_heads == NUM_QO_HEADS  # no layers registered: the model's count


def test_builder_refuses_non_causal_batches(vllm_config: VllmConfig) -> None:
    rng = torch.Generator().manual_seed(4)
    batch = Batch(rng, 16, 3, False)
    metadata = batch.metadata()
    metadata.causal = False
    builder = PrefixAttentionMetadataBuilder(_spec(), ["layer.0"], vllm_config, torch.device("cpu"))
    with pytest.raises(NotImplementedError, match="non-causal"):
        builder.build(0, metadata)


def test_kernel_block_size_for_large_kv_blocks() -> None:
    # vLLM's choice of kernel block size: a KV-manager block up to 128 is used as it is, a
    # larger one (hybrid models) is split into the largest supported size that divides it.
    from vllm.v1.worker.utils import select_common_block_size

    assert select_common_block_size(16, [PrefixAttentionBackend]) == 16
    assert select_common_block_size(24, [PrefixAttentionBackend]) == 24
    assert select_common_block_size(528, [PrefixAttentionBackend]) == 88


def test_decode_run_advances_plans(vllm_config: VllmConfig, advances: dict[str, int]) -> None:
    """Decode steps of one batch, each request one token longer per step (a new block where
    its last one is full): after the step that copies the table and the first hinted step,
    each plan is the previous one advanced, and every step's attention stays right."""
    rng = torch.Generator().manual_seed(5)
    batch = Batch(rng, 16, 8, False)
    bs, width = batch.block_table.shape
    table = torch.zeros(bs, width + 4, dtype=torch.int32)  # room for the blocks to come
    table[:, :width] = batch.block_table
    batch.block_table = table
    next_block = batch.num_blocks
    builder = PrefixAttentionMetadataBuilder(_spec(), ["l"], vllm_config, torch.device("cpu"))
    k_cache = torch.randn(batch.num_blocks + 40, 16, NUM_KV_HEADS, HEAD_DIM, generator=rng)
    v_cache = torch.randn(batch.num_blocks + 40, 16, NUM_KV_HEADS, HEAD_DIM, generator=rng)
    steps = 7
    for _ in range(steps):
        for i in range(bs):  # one more token per request
            if int(batch.seq_lens[i]) % 16 == 0:
                table[i, int(batch.seq_lens[i]) // 16] = next_block
                next_block += 1
        batch.seq_lens += 1
        metadata = builder.build(0, batch.metadata(host_lens=True))
        q = torch.randn(bs, NUM_QO_HEADS, HEAD_DIM, generator=rng)
        out = metadata.attention.run(q, k_cache, v_cache, plan=metadata.plan)
        ref = attention_reference(q, k_cache, v_cache, table, batch.seq_lens)
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-5, rtol=2e-5)
    assert builder.plan_kinds == {"copy": 1, "unshared": 0, "hinted": steps - 1, "delegated": 0}
    # Two plans (the hinted one and its fallback) per step from the third step on: the run
    # keeps the hint of its first hinted step, though the table copied then has landed.
    assert advances["advanced"] == 2 * (steps - 2) and advances["refused"] == 0


def test_hints_follow_the_runner_request_ids(vllm_config: VllmConfig) -> None:
    """vLLM's model runner gives each row's request-state index (``req_idx``): a hinted step
    whose rows were reordered keeps its shared plan, each request reading the hint row of
    its own index. Every request has the same length, so lengths alone could not tell."""
    if "req_idx" not in {f.name for f in dataclasses.fields(CommonAttentionMetadata)}:
        pytest.skip("this vLLM's attention metadata has no req_idx (its runner gives no ids)")
    rng = torch.Generator().manual_seed(5)
    batch = Batch(rng, 16, 8, False)
    batch.seq_lens[:] = int(batch.seq_lens.min())
    builder = PrefixAttentionMetadataBuilder(_spec(), ["l"], vllm_config, torch.device("cpu"))
    ids: np.ndarray | None = np.arange(20, 28)

    def step(order: list[int], grown: int) -> LaunchPlan:
        cm = batch.metadata(host_lens=True)
        lens = cm.seq_lens[order] + grown
        with_ids = ids[order] if ids is not None else None
        cm = dataclasses.replace(
            cm, block_table_tensor=cm.block_table_tensor[order], seq_lens=lens,
            seq_lens_cpu_upper_bound=lens.clone(), max_seq_len=int(lens.max()),
            req_idx=with_ids,
        )  # fmt: skip
        return builder.build(0, cm).plan

    same = list(range(8))
    assert _kind(step(same, 0)) == "copy"
    assert _kind(step(same, 1)) == "hinted"
    moved = [3, 0, 7, 1, 6, 2, 5, 4]
    assert _kind(step(moved, 2)) == "hinted"
    assert builder.planner.hint_rows["moved"] == 8  # every request on another row
    # Without ids the equal lengths keep every request on its row: the check catches it.
    ids = None
    builder = PrefixAttentionMetadataBuilder(_spec(), ["l"], vllm_config, torch.device("cpu"))
    assert [_kind(step(same, 0)), _kind(step(same, 1)), _kind(step(moved, 2))] == [
        "copy", "hinted", "hinted-fallback"
    ]  # fmt: skip


class _EngineKernel:
    """Stands in for FLASH_ATTN's builder and impl (which need a GPU) where the routing around
    them is tested: records what it was given, returns its own metadata."""

    def __init__(self) -> None:
        self.built: list[CommonAttentionMetadata] = []
        self.forwarded: list[object] = []

    def build(self, common_prefix_len: int, cm: CommonAttentionMetadata, fast_build: bool):
        self.built.append(cm)
        return ("flash_attn metadata", len(self.built))

    def forward(self, layer, query, key, value, kv_cache, metadata, output):
        self.forwarded.append(metadata)
        return output.fill_(5.0)


def test_unshared_eager_steps_run_on_vllms_kernel(
    vllm_config: VllmConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With FLASH_ATTN at hand (``delegate_builder``), a step the probe expects to share
    nothing gets FLASH_ATTN's metadata, and every layer's impl hands it to FLASH_ATTN's
    forward. The delegated step still teaches: the sharing it shows has the next step
    planned by prefixattn again, from its rows."""
    _options(monkeypatch, vllm_config, delegate_unshared=True)
    rng = torch.Generator().manual_seed(11)
    shared = Batch(rng, 16, 8, False)
    assert len(set(shared.block_table[:, 0].tolist())) < 8  # two requests share a block
    private = copy.deepcopy(shared)
    private.block_table[:, 0] = torch.arange(100, 108, dtype=torch.int32)  # no common block
    builder = PrefixAttentionMetadataBuilder(_spec(), ["l"], vllm_config, torch.device("cpu"))
    assert builder.delegate_builder is None  # a CPU device has no FLASH_ATTN kernel
    fa = _EngineKernel()
    builder.delegate_builder = fa
    steps = [
        builder.build(0, b.metadata(host_lens=True)) for b in (private, private, shared, shared)
    ]
    delegated = [not isinstance(m, vllm_backend.PrefixAttentionMetadata) for m in steps]
    assert delegated == [False, True, True, False]
    assert [cm.num_reqs for cm in fa.built] == [8, 8]
    assert _kind(steps[3].plan) == "hinted"  # from the delegated step 3's rows
    assert builder.plan_kinds == {"copy": 1, "unshared": 0, "hinted": 1, "delegated": 2}

    impl = PrefixAttentionImpl(NUM_QO_HEADS, HEAD_DIM, 0.125, NUM_KV_HEADS)
    q = torch.randn(shared.num_tokens, NUM_QO_HEADS, HEAD_DIM)
    kv = torch.zeros(PrefixAttentionBackend.get_kv_cache_shape(201, 16, NUM_KV_HEADS, HEAD_DIM))
    out = torch.zeros_like(q)
    with pytest.raises(RuntimeError, match="delegate_unshared"):
        impl.forward(_Layer(), q, q, q, kv, steps[1], out)  # no FLASH_ATTN impl on a CPU
    impl.delegate_impl = fa
    assert impl.forward(_Layer(), q, q, q, kv, steps[1], out) is out
    assert fa.forwarded == [steps[1]] and torch.all(out == 5.0)

    _options(monkeypatch, vllm_config, delegate_unshared=False)
    off = PrefixAttentionMetadataBuilder(_spec(), ["l"], vllm_config, torch.device("cpu"))
    off.delegate_builder = fa  # the option decides, even with a kernel at hand
    kinds = [_kind(off.build(0, private.metadata(host_lens=True)).plan) for _ in range(2)]
    assert kinds == ["copy", "unshared"]


def test_graph_steps_are_not_delegated(
    vllm_config: VllmConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Graph-eligible decode steps keep prefixattn's plan in the reserved buffers (a captured
    graph holds prefixattn's launches)."""
    _options(monkeypatch, vllm_config, delegate_unshared=True)
    rng = torch.Generator().manual_seed(3)
    private = Batch(rng, 16, 4, False)
    private.block_table[:, 0] = torch.arange(100, 104, dtype=torch.int32)
    builder = PrefixAttentionMetadataBuilder(_spec(), ["l"], vllm_config, torch.device("cpu"))
    builder.delegate_builder = _EngineKernel()
    builder.full_graphs = True
    builder.max_graph_tokens = 8
    builder.reserve_for_graphs()
    steps = [builder.build(0, private.metadata(host_lens=True)) for _ in range(3)]
    assert all(isinstance(m, vllm_backend.PrefixAttentionMetadata) for m in steps)
    assert builder.plan_kinds["delegated"] == 0 and builder.plan_kinds["unshared"] == 2


def test_vllms_kernel_is_refused_by_name_where_it_cannot_run() -> None:
    """Why a configuration keeps unshared steps on prefixattn: named, not guessed."""
    from prefixattn.adapters.vllm import delegate

    reason = delegate.unavailable_reason(16, HEAD_DIM, torch.bfloat16)
    assert reason is not None  # this machine has no CUDA
    assert "CUDA" in reason or "FlashAttention" in reason or "layout" in reason


def test_graphs_of_one_request_run_on_vllms_kernel(
    vllm_config: VllmConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A graph batch of one decode token is one request, which shares nothing: it gets
    FLASH_ATTN's metadata at capture and at every replay, by its padded shape alone (with
    ``delegate_unshared``; off by default)."""
    off = PrefixAttentionMetadataBuilder(_spec(), ["l"], vllm_config, torch.device("cpu"))
    off.delegate_builder = _EngineKernel()
    assert not off.single_request_graph(1)
    _options(monkeypatch, vllm_config, delegate_unshared=True)
    rng = torch.Generator().manual_seed(3)
    one = Batch(rng, 16, 1, False)
    builder = PrefixAttentionMetadataBuilder(_spec(), ["l"], vllm_config, torch.device("cpu"))
    fa = _EngineKernel()
    builder.delegate_builder = fa
    builder.full_graphs = True
    builder.max_graph_tokens = 8
    builder.reserve_for_graphs()
    captured = builder.build_for_cudagraph_capture(one.metadata(host_lens=True))
    replayed = builder.build(0, one.metadata(host_lens=True))
    assert captured == ("flash_attn metadata", 1) and replayed == ("flash_attn metadata", 2)
    assert builder.plan_kinds["delegated"] == 1  # the replay; capture batches are not counted
    assert builder.delegated_captures == 1 and builder.graph.captured_generation is None
    # Two tokens: another graph, planned by prefixattn.
    two = Batch(rng, 16, 2, False)
    assert isinstance(
        builder.build(0, two.metadata(host_lens=True)), vllm_backend.PrefixAttentionMetadata
    )


def _decodes_first(batch: Batch) -> Batch:
    """``batch`` with its requests reordered as vLLM does for a backend that asks for it
    (``reorder_batch_threshold`` 1): decodes first, then the longer chunks."""
    q = (batch.qo_indptr[1:] - batch.qo_indptr[:-1]).numpy()
    order = np.argsort(q > 1, kind="stable")
    out = copy.deepcopy(batch)
    out.block_table = batch.block_table[order].clone()
    out.seq_lens = batch.seq_lens[order].clone()
    out.qo_indptr = torch.zeros_like(batch.qo_indptr)
    out.qo_indptr[1:] = torch.cumsum(torch.from_numpy(q[order]), 0)
    slots = [batch.slot_mapping[batch.qo_indptr[i] : batch.qo_indptr[i + 1]] for i in order]
    out.slot_mapping = torch.cat(slots)
    return out


def test_prefill_chunks_run_on_vllms_kernel_beside_planned_decodes(
    vllm_config: VllmConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An eager step with prefill chunks after its decodes: prefixattn plans the decodes (rows
    checked against plain attention), FLASH_ATTN gets the chunks' requests alone (their own
    query offsets, lengths, table rows and slots) and fills the rows after them."""
    _options(monkeypatch, vllm_config, delegate_prefills=True)
    rng = torch.Generator().manual_seed(21)
    batch = _decodes_first(Batch(rng, 16, 12, True))
    q = (batch.qo_indptr[1:] - batch.qo_indptr[:-1]).numpy()
    nd = int(np.argmax(q > 1))
    assert 0 < nd < 12 and (q[nd:] > 1).all()
    builder = PrefixAttentionMetadataBuilder(_spec(), ["l"], vllm_config, torch.device("cpu"))
    fa = _EngineKernel()
    builder.delegate_builder = fa
    builder.planner.probe.observe(np.array([1, 1]))  # sharing seen: no whole-step delegation
    cm = batch.metadata(host_lens=True)
    positions = torch.arange(batch.num_tokens)
    cm = dataclasses.replace(cm, positions=positions, logits_indices_padded=positions)
    md = builder.build(0, cm)
    assert isinstance(md, vllm_backend.PrefixAttentionMetadata)
    first = int(batch.qo_indptr[nd])
    assert md.num_tokens == first == md.plan.num_tokens
    sub = fa.built[-1]
    assert sub.num_reqs == 12 - nd and sub.num_actual_tokens == batch.num_tokens - first
    assert sub.query_start_loc_cpu.tolist() == (batch.qo_indptr[nd:] - first).tolist()
    assert torch.equal(sub.query_start_loc, sub.query_start_loc_cpu)
    assert torch.equal(sub.block_table_tensor, batch.block_table[nd:])
    assert torch.equal(sub.seq_lens, batch.seq_lens[nd:])
    assert torch.equal(sub.slot_mapping, batch.slot_mapping[first:])
    assert sub.max_query_len == int(q[nd:].max())
    # The planner looked at every request, the chunks' too (the next step's hint).
    hint = builder.planner.table_hint.take()
    assert hint is not None and hint.shape[0] == 12
    assert (hint[nd:, 0] == batch.block_table[nd:, 0].numpy()).all()
    # The next such step plans its decodes from that hint, and looks at all of it again.
    again = builder.build(0, cm)
    assert isinstance(again, vllm_backend.PrefixAttentionMetadata) and again.prefill is not None
    assert _kind(again.plan).startswith("hinted") and again.num_tokens == first
    hint = builder.planner.table_hint.take()
    assert hint is not None and hint.shape[0] == 12
    # Other per-token fields: sliced (positions) or left out, never the whole batch's.
    assert torch.equal(sub.positions, positions[first:]) and sub.logits_indices_padded is None

    scale = HEAD_DIM**-0.5
    shape = PrefixAttentionBackend.get_kv_cache_shape(batch.num_blocks, 16, NUM_KV_HEADS, HEAD_DIM)
    kv = torch.randn(shape, generator=rng)
    impl = PrefixAttentionImpl(NUM_QO_HEADS, HEAD_DIM, scale, NUM_KV_HEADS)
    impl.delegate_impl = fa
    query = torch.randn(batch.num_tokens, NUM_QO_HEADS, HEAD_DIM, generator=rng)
    out = torch.zeros_like(query)
    impl.forward(_Layer(), query, query, query, kv, md, out)
    assert fa.forwarded[-1] is md.prefill and torch.all(out[first:] == 5.0)
    k_nhd = kv.transpose(1, 2)[..., :HEAD_DIM]
    v_nhd = kv.transpose(1, 2)[..., HEAD_DIM:]
    ref = attention_reference(
        query[:first].double(), k_nhd.double(), v_nhd.double(), batch.block_table[:nd],
        batch.seq_lens[:nd], batch.qo_indptr[: nd + 1], scale=scale,
    )  # fmt: skip
    torch.testing.assert_close(out[:first].double(), ref, atol=1e-5, rtol=1e-5)

    # Chunks not all after the decodes (no reorder): prefixattn plans the whole step.
    assert builder.prefill_split(np.ones(5, np.int32)) is None
    assert builder.prefill_split(np.array([1, 1, 9, 3])) == 2
    assert builder.prefill_split(np.array([9, 1, 3])) is None
    # Prefill chunks alone: FLASH_ATTN runs the whole step.
    alone = copy.deepcopy(batch)
    alone.block_table, alone.seq_lens = batch.block_table[nd:], batch.seq_lens[nd:]
    alone.qo_indptr = batch.qo_indptr[nd:] - first
    alone.slot_mapping, alone.num_tokens = batch.slot_mapping[first:], batch.num_tokens - first
    whole = builder.build(0, alone.metadata(host_lens=True))
    assert whole == ("flash_attn metadata", len(fa.built)) and fa.built[-1].num_reqs == 12 - nd


def test_prefill_chunks_stay_with_prefixattn_by_default(vllm_config: VllmConfig) -> None:
    builder = PrefixAttentionMetadataBuilder(_spec(), ["l"], vllm_config, torch.device("cpu"))
    builder.delegate_builder = _EngineKernel()
    assert builder.prefill_split(np.array([1, 1, 9, 3])) is None
