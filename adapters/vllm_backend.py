"""vLLM 0.26 attention backend: vLLM's paged KV cache and batch metadata in, prefixattn out.

Four parts, as vLLM's own backends have them:

- :class:`PrefixAttentionBackend`: what the backend supports and how its KV cache is laid out.
- :class:`PrefixAttentionMetadata`: the step's plan, shared by every layer.
- :class:`PrefixAttentionMetadataBuilder`: one :meth:`PrefixAttention.plan` per step from
  ``CommonAttentionMetadata``.
- :class:`PrefixAttentionImpl`: writes new K/V into the cache and calls
  :meth:`PrefixAttention.run` per layer.

Prefix sharing needs nothing from vLLM beyond prefix caching (on by default): requests with a
common prefix have identical leading block ids in ``block_table_tensor``, which the core's plan
turns into work items that read each shared block once. Every request of a step (decodes,
prefill and extend chunks, speculative verification with several query tokens) goes through the
same causal plan.

KV cache: logical shape ``(num_blocks, num_kv_heads, block_size, 2 * head_size)`` with K in the
first and V in the second half of the last dimension, stored block-major with tokens before
heads (stride order ``(0, 2, 1, 3)``), i.e. in memory ``[num_blocks, block_size, num_kv_heads,
2 * head_size]``. The K and V halves are NHD views with a contiguous last dimension, which the
core reads in place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)

from prefixattn import PrefixAttention
from prefixattn.api import MAX_PAGE_SIZE
from prefixattn.plan import LaunchPlan
from prefixattn.tiles import SUPPORTED_HEAD_DIMS


class PrefixAttentionBackend(AttentionBackend):
    """prefixattn as vLLM's ``CUSTOM`` attention backend (decoder self-attention, causal)."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    # The core reads the cache in the model's dtype; fp8 caches are refused.
    supported_kv_cache_dtypes: ClassVar[list[Any]] = ["auto", "float16", "bfloat16"]
    forward_includes_kv_cache_update: bool = False

    @staticmethod
    def get_name() -> str:
        # vLLM maps the name back to AttentionBackendEnum[name]; the registered slot is CUSTOM.
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[PrefixAttentionImpl]:
        return PrefixAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[PrefixAttentionMetadataBuilder]:
        return PrefixAttentionMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype_str: str = "auto",
    ) -> tuple[int, ...]:
        return (num_blocks, num_kv_heads, block_size, 2 * head_size)

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension: bool = False) -> tuple[int, ...]:
        # Memory order [num_blocks, block_size, num_kv_heads, 2 * head_size] (NHD); with the
        # layers dimension vLLM puts it right after num_blocks.
        if include_num_layers_dimension:
            return (1, 0, 3, 2, 4)
        return (0, 2, 1, 3)

    @staticmethod
    def get_supported_kernel_block_sizes() -> list[int | MultipleOf]:
        # Any page size from 1 to MAX_PAGE_SIZE; vLLM's defaults (16, and multiples of 16 for
        # hybrid models) are all in range.
        return [MultipleOf(1)]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(SUPPORTED_HEAD_DIMS)

    @classmethod
    def supports_block_size(cls, block_size: int | None) -> bool:
        return block_size is None or 1 <= block_size <= MAX_PAGE_SIZE

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_combination(
        cls,
        head_size: int,
        dtype: torch.dtype,
        kv_cache_dtype: Any,
        block_size: int | None,
        use_mla: bool,
        has_sink: bool,
        use_sparse: bool,
        use_mm_prefix: bool,
        device_capability: Any,
    ) -> str | None:
        return None


@dataclass
class PrefixAttentionMetadata:
    """The step's attention metadata, built once and read by every layer."""

    attention: PrefixAttention
    """The object that built ``plan`` (owns its device buffers)."""
    plan: LaunchPlan
    """The step's launch plan: rows ``0:num_tokens`` of the query."""
    num_tokens: int
    """Tokens with attention output this step (``query_start_loc[num_reqs]``)."""
    num_actual_tokens: int
    """vLLM's token count for the step (may include padding beyond ``num_tokens``)."""
    slot_mapping: torch.Tensor
    """int64 [num_actual_tokens]; cache slot (block_id * block_size + offset) of each new token,
    -1 for padding."""


class PrefixAttentionMetadataBuilder(AttentionMetadataBuilder[PrefixAttentionMetadata]):
    """Builds one plan per step from ``block_table_tensor``, ``seq_lens`` and ``query_start_loc``.

    The plan is host work (prefix forest, packing, tile choice). ``query_start_loc_cpu`` is
    vLLM's own host copy; the block table rows and ``seq_lens`` live only on the device in
    ``CommonAttentionMetadata``, so building the plan copies ``num_reqs`` rows of the block table
    (only the columns the longest sequence uses) and ``seq_lens`` to the host: one
    device-to-host copy per step, not per layer.

    CUDA graphs: ``NEVER``. The plan changes with every step's block tables (its work-item
    count and array lengths are host decisions), so attention runs outside captured graphs;
    vLLM's default mode then captures the rest of the model piecewise and runs attention eagerly
    between the pieces.
    """

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER
    reorder_batch_threshold: int | None = None

    def __init__(
        self,
        kv_cache_spec: Any,
        layer_names: list[str],
        vllm_config: Any,
        device: torch.device,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        model_config = vllm_config.model_config
        self.num_qo_heads = model_config.get_num_attention_heads(vllm_config.parallel_config)
        self.num_kv_heads = kv_cache_spec.num_kv_heads
        self.head_dim = kv_cache_spec.head_size
        self.block_size = kv_cache_spec.block_size
        self.attention = PrefixAttention(
            self.num_qo_heads,
            self.num_kv_heads,
            self.head_dim,
            self.block_size,
            kv_layout="NHD",
            device=device,
            dtype=kv_cache_spec.dtype,
        )

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> PrefixAttentionMetadata:
        cm = common_attn_metadata
        b = cm.num_reqs
        qo_indptr = cm.query_start_loc_cpu[: b + 1].to(torch.int32)
        # Worked example: block_size 16, max_seq_len 40 -> 3 columns used.
        cols = min(-(-cm.max_seq_len // self.block_size), cm.block_table_tensor.shape[1])
        block_table = cm.block_table_tensor[:b, :cols].to(torch.int32)
        seq_lens = cm.seq_lens[:b].to(torch.int32)
        # One device-to-host copy of both arrays (plan() would copy each separately).
        host = torch.cat([seq_lens.unsqueeze(1), block_table], dim=1).cpu()
        plan = self.attention.plan(host[:, 1:].contiguous(), host[:, 0].contiguous(), qo_indptr)
        return PrefixAttentionMetadata(
            attention=self.attention,
            plan=plan,
            num_tokens=int(qo_indptr[-1]),
            num_actual_tokens=cm.num_actual_tokens,
            slot_mapping=cm.slot_mapping,
        )


class PrefixAttentionImpl(AttentionImpl[PrefixAttentionMetadata]):
    """Per-layer attention: writes the step's K/V into the paged cache, then runs the plan."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        **extra: Any,
    ) -> None:
        unsupported = [
            name
            for name, value in (
                ("ALiBi", alibi_slopes),
                ("sliding window", sliding_window),
                ("logits soft cap", logits_soft_cap or None),
            )
            if value is not None
        ]
        if attn_type != AttentionType.DECODER:
            unsupported.append(f"attention type {attn_type}")
        if kv_cache_dtype not in PrefixAttentionBackend.supported_kv_cache_dtypes:
            unsupported.append(f"kv_cache_dtype {kv_cache_dtype}")
        if unsupported:
            raise NotImplementedError(
                "prefixattn backend does not support: " + ", ".join(unsupported)
            )
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name

    def _split_cache(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Logical (blocks, heads, tokens, 2D) -> NHD views (blocks, tokens, heads, D) of K and V.
        k_cache, v_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
        return k_cache, v_cache

    def do_kv_cache_update(
        self,
        layer: torch.nn.Module,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Write new K/V ``[T, Hkv, D]`` to slots ``slot_mapping`` (int64 [n], -1 = padding)."""
        k_cache, v_cache = self._split_cache(kv_cache)
        if kv_cache.is_cuda:
            from vllm import _custom_ops as ops

            # Reads only slot_mapping.shape[0] tokens and skips slots < 0.
            ops.reshape_and_cache_flash(
                key,
                value,
                k_cache,
                v_cache,
                slot_mapping,
                self.kv_cache_dtype,
                layer._k_scale,  # type: ignore[arg-type]
                layer._v_scale,  # type: ignore[arg-type]
            )
            return
        n = slot_mapping.shape[0]
        valid = slot_mapping >= 0
        slots = slot_mapping[valid]
        blocks = torch.div(slots, k_cache.shape[1], rounding_mode="floor")
        offsets = slots - blocks * k_cache.shape[1]
        k_cache[blocks, offsets] = key[:n][valid].to(k_cache.dtype)
        v_cache[blocks, offsets] = value[:n][valid].to(v_cache.dtype)

    def forward(
        self,
        layer: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: PrefixAttentionMetadata | None,
        output: torch.Tensor | None = None,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """query ``[T, Hq, D]``; fills ``output[:num_tokens]`` (``[T, Hq, D]``) and returns it."""
        assert output is not None, "output tensor is required"
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported")
        if attn_metadata is None:
            # Profiling run: no plan, nothing to attend to.
            return output.fill_(0)
        n = attn_metadata.num_tokens
        k_cache, v_cache = self._split_cache(kv_cache)
        out = output[:n].view(n, self.num_heads, self.head_size)
        attn_metadata.attention.run(
            query[:n].view(n, self.num_heads, self.head_size),
            k_cache,
            v_cache,
            scale=self.scale,
            out=out,
            plan=attn_metadata.plan,
        )
        return output
