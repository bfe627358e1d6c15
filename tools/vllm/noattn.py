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

``PREFIXFLOOR`` (:class:`PrefixFloorBackend`, :func:`register_floor`) is the same bound plus
one cost: each decode forward runs the shared prefix's attention math, and nothing else, on
FA3 (``vllm.vllm_flash_attn``): every query of the batch against a fixed P-token K/V of the
layer's KV heads (``tools/prefix_floor.py``).

``KVFLOOR`` (:class:`KvFloorBackend`, :func:`register_kv_floor`) is the bound plus the
step's distinct KV read once per layer (``tools/kv_floor.py``): each page of the step's
block table that a request's length reaches, once, K and V (one span per page in
FLASH_ATTN's cache). No exact attention backend reads less.

Importing this module imports vLLM.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend, FlashAttentionImpl

NAME = "NOATTN"
BACKEND_PATH = "tools.vllm.noattn.NoAttentionBackend"
FLOOR = "PREFIXFLOOR"
FLOOR_PATH = "tools.vllm.noattn.PrefixFloorBackend"
FLOOR_TOKENS = 0
"""The prefix length of ``PREFIXFLOOR`` in this process (:func:`register_floor`)."""


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


class PrefixFloorImpl(NoAttentionImpl):
    """The bound's impl plus FA3 over every decode query against ``FLOOR_TOKENS`` keys."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        import torch
        from vllm.config import get_current_vllm_config

        from tools.prefix_floor import random_kv

        device = torch.device("cuda", torch.cuda.current_device())
        dtype = get_current_vllm_config().model_config.dtype
        ((k, v),) = random_kv(1, FLOOR_TOKENS, self.num_kv_heads, self.head_size, dtype, device)
        self.floor_k, self.floor_v = k[0], v[0]  # [P, kv heads, dims]: the varlen layout
        self.floor_cu_k = torch.tensor([0, FLOOR_TOKENS], dtype=torch.int32, device=device)
        self.floor_cu_q = torch.zeros(2, dtype=torch.int32, device=device)

    def forward(
        self, layer: Any, query: Any, key: Any, value: Any, kv_cache: Any, attn_metadata: Any,
        output: Any, *args: Any, **kwargs: Any,
    ) -> Any:  # fmt: skip
        """Decode steps (every request one query token): FA3 of all of ``query``'s rows
        (padded ones included) against the layer's fixed prefix, into ``output``; other
        steps: zeros, as the bound."""
        if attn_metadata is None or attn_metadata.max_query_len != 1:
            return output.zero_()
        from tools.prefix_floor import fa3_varlen

        n = query.shape[0]
        self.floor_cu_q[1:].fill_(n)  # one kernel, captured with the step's graph
        fa3_varlen()[1](query, self.floor_k, self.floor_v, self.floor_cu_q, self.floor_cu_k, n,
                        FLOOR_TOKENS, self.scale, output[:n])  # fmt: skip
        return output


class PrefixFloorBackend(NoAttentionBackend):
    """The bound with :class:`PrefixFloorImpl`."""

    @staticmethod
    def get_name() -> str:
        return FLOOR

    @staticmethod
    def get_impl_cls() -> type[PrefixFloorImpl]:
        return PrefixFloorImpl


KV_FLOOR = "KVFLOOR"
KV_FLOOR_PATH = "tools.vllm.noattn.KvFloorBackend"
_STEP_PAGES: Any = None
"""The step's pages to read (``tools.kv_floor.StepPages``), one for all layers' impls."""


def _layer_index(layer: Any) -> int:
    """The index in ``layer.layer_name`` (``model.layers.7.self_attn.attn`` -> 7), else 0."""
    for part in str(getattr(layer, "layer_name", "")).split("."):
        if part.isdigit():
            return int(part)
    return 0


class KvFloorImpl(NoAttentionImpl):
    """The bound's impl plus the step's distinct KV pages read once (``tools/kv_floor.py``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        import torch

        from tools.kv_floor import sink_for

        self.sink = sink_for(torch.device("cuda", torch.cuda.current_device()))

    def forward(
        self, layer: Any, query: Any, key: Any, value: Any, kv_cache: Any, attn_metadata: Any,
        output: Any, *args: Any, **kwargs: Any,
    ) -> Any:  # fmt: skip
        """Zeros in ``output``, as the bound; then the layer's KV pages that the step's
        requests reach, each once (FLASH_ATTN's cache: ``[pages, kv heads, block_size, 2 x
        dims]``, each page's K and V one span of memory). Fixed shapes and no host sync:
        safe under CUDA graph capture."""
        output.zero_()
        if attn_metadata is None:  # vLLM's memory-profiling run
            return output
        from tools.kv_floor import StepPages, distinct_pages, first_reads, read_pages

        if tuple(getattr(self, "sliding_window", (-1, -1))) != (-1, -1):
            raise ValueError("KVFLOOR: the floor reads whole contexts; this layer has a window")
        if kv_cache.dim() != 4:
            raise ValueError(
                f"KVFLOOR: KV cache {tuple(kv_cache.shape)} is not FLASH_ATTN's "
                "[pages, kv heads, block_size, 2 x head_size]"
            )
        global _STEP_PAGES
        if _STEP_PAGES is None:
            _STEP_PAGES = StepPages()
        pages, count = _STEP_PAGES.get(
            attn_metadata,
            _layer_index(layer),
            lambda: distinct_pages(*first_reads(
                attn_metadata.block_table, attn_metadata.seq_lens, kv_cache.shape[2],
                kv_cache.shape[0],
            )),
        )  # fmt: skip
        read_pages([kv_cache.transpose(1, 2)], pages, count, self.sink)
        return output


class KvFloorBackend(NoAttentionBackend):
    """The bound with :class:`KvFloorImpl`."""

    @staticmethod
    def get_name() -> str:
        return KV_FLOOR

    @staticmethod
    def get_impl_cls() -> type[KvFloorImpl]:
        return KvFloorImpl


def _register(name: str, path: str) -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if name in AttentionBackendEnum.__members__:
        register_backend(AttentionBackendEnum[name], path)
    else:
        register_backend(name, path)


def register() -> None:
    """Add ``NOATTN`` to vLLM's ``AttentionBackendEnum`` (idempotent)."""
    _register(NAME, BACKEND_PATH)


def register_floor(tokens: int) -> None:
    """Add ``PREFIXFLOOR`` with a ``tokens``-token prefix (idempotent)."""
    from tools.prefix_floor import check_floor_tokens

    global FLOOR_TOKENS
    FLOOR_TOKENS = check_floor_tokens(tokens)
    _register(FLOOR, FLOOR_PATH)


def register_kv_floor() -> None:
    """Add ``KVFLOOR`` to vLLM's ``AttentionBackendEnum`` (idempotent)."""
    _register(KV_FLOOR, KV_FLOOR_PATH)
