"""vLLM plugin: registers prefixattn as vLLM's ``CUSTOM`` attention backend.

vLLM calls :func:`register` through the ``vllm.general_plugins`` entry point in every process
it starts (engine core, workers). Select the backend with ``--attention-backend CUSTOM`` or
``LLM(..., attention_backend="CUSTOM")``. Importing ``prefixattn`` never imports vLLM.
"""

from __future__ import annotations

BACKEND_PATH = "prefixattn.adapters.vllm.backend.PrefixAttentionBackend"


def register() -> None:
    """Put the backend in ``AttentionBackendEnum.CUSTOM`` (idempotent: vLLM may call it often)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH)
