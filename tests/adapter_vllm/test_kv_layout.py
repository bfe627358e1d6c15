"""vLLM 0.29+ KV cache layouts: per-layer views from vLLM's own allocator, for each layout the
backend declares (skipped on vLLM 0.26-0.28, which ask the backend for a shape instead)."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("vllm")
pytest.importorskip("vllm.v1.kv_cache_layout")

import torch
from test_backend import HEAD_DIM, NUM_KV_HEADS, NUM_QO_HEADS, Batch, _Layer, vllm_config  # noqa: F401
from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheTensor, create_kv_cache_views
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import select_common_block_size

from prefixattn import attention_reference
from prefixattn.adapters.vllm.backend import (
    PrefixAttentionBackend,
    PrefixAttentionImpl,
    PrefixAttentionMetadataBuilder,
)

NUM_LAYERS = 3


def _views(layout, spec, num_blocks: int) -> list[torch.Tensor]:
    page = spec.page_size_bytes
    size = page * num_blocks * NUM_LAYERS
    if layout.is_layer_compact:  # L outermost
        tensor = KVCacheTensor(size=size, layers=[f"l{i}" for i in range(NUM_LAYERS)],
                               layer_stride=page * num_blocks, block_stride=page)  # fmt: skip
    else:  # B outermost: a block holds every layer's page
        tensor = KVCacheTensor(size=size, layers=[f"l{i}" for i in range(NUM_LAYERS)],
                               layer_stride=page, block_stride=page * NUM_LAYERS)  # fmt: skip
    raw = torch.randn(size // 4).view(torch.int8)  # random bytes, as a reused cache has
    return create_kv_cache_views(raw, spec, num_blocks, layout, tensor)


def test_declared_layouts_resolve() -> None:
    layouts = get_supported_kv_cache_layouts([PrefixAttentionBackend])
    assert layouts[0] == KVCacheLayout.LBNHC


def test_kernel_block_size_takes_the_spec() -> None:
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    assert select_common_block_size(16, [PrefixAttentionBackend], [spec]) == 16
    assert select_common_block_size(528, [PrefixAttentionBackend], [spec]) == 88


@pytest.mark.parametrize("layout", [m for m in KVCacheLayout if m.is_block_compact])
@pytest.mark.parametrize("seed", [0, 1])
def test_forward_on_vllm_views(vllm_config, layout, seed: int) -> None:  # noqa: F811
    dtype, block_size = torch.float32, 16
    rng = torch.Generator().manual_seed(seed)
    batch = Batch(rng, block_size, 9, True)
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_DIM, dtype=dtype
    )
    kv_cache = _views(layout, spec, batch.num_blocks)[1]
    assert tuple(kv_cache.shape) == (batch.num_blocks, NUM_KV_HEADS, block_size, 2 * HEAD_DIM)
    builder = PrefixAttentionMetadataBuilder(spec, ["l1"], vllm_config, torch.device("cpu"))
    metadata = builder.build(0, batch.metadata())
    scale = 1 / math.sqrt(HEAD_DIM)
    impl = PrefixAttentionImpl(NUM_QO_HEADS, HEAD_DIM, scale, NUM_KV_HEADS)
    t = batch.num_tokens
    q = torch.randn(t, NUM_QO_HEADS, HEAD_DIM, generator=rng)
    k = torch.randn(t, NUM_KV_HEADS, HEAD_DIM, generator=rng)
    v = torch.randn(t, NUM_KV_HEADS, HEAD_DIM, generator=rng)
    impl.do_kv_cache_update(_Layer(), k, v, kv_cache, batch.slot_mapping)
    out = torch.zeros(t, NUM_QO_HEADS, HEAD_DIM)
    impl.forward(_Layer(), q, k, v, kv_cache, metadata, out)
    k_nhd = kv_cache.transpose(1, 2)[..., :HEAD_DIM]
    v_nhd = kv_cache.transpose(1, 2)[..., HEAD_DIM:]
    ref = attention_reference(q.double(), k_nhd.double(), v_nhd.double(), batch.block_table,
                              batch.seq_lens, batch.qo_indptr, scale=scale)  # fmt: skip
    assert (out.double() - ref).abs().max().item() < 1e-4


def test_adaptive_verification_is_refused() -> None:
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backend import AttentionType

    reasons = PrefixAttentionBackend.validate_configuration(
        head_size=128, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=16,
        use_mla=False, has_sink=False, use_sparse=False, use_mm_prefix=False,
        use_per_head_quant_scales=False, device_capability=DeviceCapability(9, 0),
        attn_type=AttentionType.DECODER, use_adaptive_verification=True,
    )  # fmt: skip
    assert any("adaptive verification" in r for r in reasons), reasons
