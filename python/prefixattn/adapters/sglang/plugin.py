"""SGLang plugin: makes ``--attention-backend prefixattn`` a valid choice and registers its factory.

Installed as the ``prefixattn`` entry point of the ``sglang.srt.plugins`` group, so SGLang's
``load_plugins()`` calls :func:`register` in the main process and in every spawned scheduler
process. Importing this module imports neither SGLang nor the backend; :func:`register`
imports SGLang's registries, and the factory imports the backend only when a model runner
asks for it.
"""

from __future__ import annotations

from typing import Any

BACKEND_NAME = "prefixattn"


def create_backend(model_runner: Any) -> Any:
    """SGLang attention-registry factory: ``fn(model_runner) -> AttentionBackend``."""
    if getattr(model_runner, "use_mla_backend", False):
        raise ValueError(
            "the prefixattn attention backend serves MHA/GQA models; this model uses MLA"
        )
    from prefixattn.adapters.sglang.backend import PrefixAttnBackend

    return PrefixAttnBackend(model_runner)


def register_backend(name: str, factory: Any) -> None:
    """Add ``name`` to SGLang's attention-backend choices and its ``factory`` (``fn(model_runner)
    -> AttentionBackend``) to the registry (idempotent)."""
    from sglang.srt.layers.attention.attention_registry import (
        ATTENTION_BACKENDS,
        register_attention_backend,
    )
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices

    if name not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([name])
    if ATTENTION_BACKENDS.get(name) is not factory:
        register_attention_backend(name)(factory)


def register() -> None:
    """Add ``prefixattn`` to SGLang's attention-backend choices and registry (idempotent)."""
    register_backend(BACKEND_NAME, create_backend)
