"""vLLM's own ``FLASH_ATTN`` kernel for the steps prefixattn gains nothing on.

A step whose requests share no page (:class:`~prefixattn.engine.step.StepPlanner` decides it
from its sharing probe) reads what every backend reads; long private prefills run fastest on a
dense prefill kernel. Where ``StepOptions.delegate_unshared`` is on, such steps that vLLM does
not replay from a full CUDA graph run on vLLM's ``FlashAttentionImpl`` with metadata from its
``FlashAttentionMetadataBuilder``, over the same KV cache: from vLLM 0.29 both backends view
the cache as ``(num_blocks, num_kv_heads, block_size, 2 * head_size)`` and split K and V in the
last dimension, and both write new K/V with ``reshape_and_cache_flash`` apart from ``forward``.

:func:`unavailable_reason` says why a configuration cannot delegate (the builder then plans
such steps itself); the builder and every layer's impl ask it with the same arguments, so they
agree.
"""

from __future__ import annotations

from typing import Any

import torch

try:  # vLLM >= 0.29: one KV cache layout for the model, resolved across its backends
    from vllm.v1.kv_cache_layout import KVCacheLayout
except ImportError:  # vLLM 0.26-0.28: FLASH_ATTN keeps K and V in planes of their own
    KVCacheLayout = None

FLASH_ATTN_BLOCK_MULTIPLE = 16
"""``FLASH_ATTN`` reads the paged cache in blocks of a multiple of 16 tokens."""


def _flash_attn() -> Any:
    """vLLM's ``flash_attn`` backend module (raises ImportError where it does not load)."""
    from vllm.v1.attention.backends import flash_attn

    return flash_attn


def unavailable_reason(block_size: int | None, head_size: int, dtype: torch.dtype) -> str | None:
    """Why steps cannot run on vLLM's ``FLASH_ATTN`` kernel here, or None where they can.
    ``block_size`` None: not known yet (a layer's impl is made before the cache), not checked."""
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        return "not a CUDA platform"
    if KVCacheLayout is None:
        return "vLLM < 0.29 lays FLASH_ATTN's cache out differently"
    if block_size is not None and block_size % FLASH_ATTN_BLOCK_MULTIPLE:
        return f"block size {block_size} is no multiple of {FLASH_ATTN_BLOCK_MULTIPLE}"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"KV cache dtype {dtype}"
    try:
        fa = _flash_attn()
        from vllm.v1.attention.backends.fa_utils import is_flash_attn_varlen_func_available
    except ImportError as e:
        return f"vLLM's flash_attn backend does not import ({e})"
    backend = fa.FlashAttentionBackend
    if not is_flash_attn_varlen_func_available():
        return "vLLM's FlashAttention kernels are not available"
    if "get_kv_cache_shape" in vars(backend) or getattr(
        backend, "forward_includes_kv_cache_update", True
    ):
        return "this vLLM's FLASH_ATTN lays out or writes its cache differently"
    if not backend.supports_head_size(head_size):
        return f"FLASH_ATTN does not support head size {head_size}"
    return None


def new_builder(
    kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: torch.device
) -> Any:
    """``FLASH_ATTN``'s metadata builder for this group's layers."""
    return _flash_attn().FlashAttentionMetadataBuilder(
        kv_cache_spec, layer_names, vllm_config, device
    )


def new_impl(**kwargs: Any) -> Any:
    """``FLASH_ATTN``'s impl for one layer, from the arguments vLLM gave prefixattn's."""
    return _flash_attn().FlashAttentionImpl(**kwargs)
