"""vLLM's attention-free bound: FLASH_ATTN's metadata path, no attention work.

A benchmark-only backend, never installed for users (``tools/serving/bench.py`` runs it).
``NoAttentionBackend`` subclasses vLLM's ``FlashAttentionBackend``, so everything but the
attention itself is FLASH_ATTN's: the metadata builder (the engine's per-step host work and the
builder's own device work run unchanged), the KV-cache shape, layouts and block sizes, and the
CUDA-graph support (``FlashAttentionMetadataBuilder._cudagraph_support``: ``ALWAYS`` with
FA3/FA4, else ``UNIFORM_BATCH``), so the same graphs are captured. ``NoAttentionImpl`` writes
zeros into ``output`` and its KV-cache update, which vLLM 0.33 calls apart from ``forward``
(``forward_includes_kv_cache_update`` is False; ``unified_kv_cache_update`` calls
``impl.do_kv_cache_update``), writes nothing: no KV is read or written and nothing is computed.

:func:`register` adds ``NOATTN`` to ``AttentionBackendEnum`` (vLLM 0.32+:
``register_backend("NOATTN", path)``); then ``LLM(..., attention_backend="NOATTN")`` selects
it. The enum member exists only in processes that registered it or were forked from one: run
the engine core in the registering process (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` for ``LLM``)
or in a forked child (``AsyncLLM``'s engine core with vLLM's default ``fork`` start method,
CUDA not initialized in the parent). A spawned engine core fails while unpickling the
configuration (``AttentionBackendEnum('tools.vllm.noattn.NoAttentionBackend')`` is unknown
there).

Importing this module imports vLLM.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend, FlashAttentionImpl

NAME = "NOATTN"
BACKEND_PATH = "tools.vllm.noattn.NoAttentionBackend"


class NoAttentionImpl(FlashAttentionImpl):
    """FLASH_ATTN's impl (same constructor and checks) without its kernels."""

    def forward(
        self,
        layer: Any,
        query: Any,
        key: Any,
        value: Any,
        kv_cache: Any,
        attn_metadata: Any,
        output: Any,
        output_scale: Any = None,
        output_block_scale: Any = None,
    ) -> Any:
        """Zeros in ``output`` ([num_tokens, num_heads, head_size_v], padded tokens included);
        returns ``output``. Safe under CUDA graph capture (one memset)."""
        return output.zero_()

    def do_kv_cache_update(
        self, layer: Any, key: Any, value: Any, kv_cache: Any, slot_mapping: Any
    ) -> None:
        """Writes nothing: the bound stores no KV."""


class NoAttentionBackend(FlashAttentionBackend):
    """FLASH_ATTN with :class:`NoAttentionImpl`; its own name, so that vLLM's
    ``AttentionBackendEnum[backend.get_name()]`` finds the registered member."""

    @staticmethod
    def get_name() -> str:
        return NAME

    @staticmethod
    def get_impl_cls() -> type[NoAttentionImpl]:
        return NoAttentionImpl


def register() -> None:
    """Add ``NOATTN`` to vLLM's ``AttentionBackendEnum`` (idempotent)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if NAME in AttentionBackendEnum.__members__:
        register_backend(AttentionBackendEnum[NAME], BACKEND_PATH)
    else:
        register_backend(NAME, BACKEND_PATH)
