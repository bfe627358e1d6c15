"""SGLang's attention-free bound: the triton backend's metadata path, no attention work.

A benchmark-only backend, never installed for users (``tools/serving/bench.py`` runs it as
``attention_backend="noattn"``). The backend subclasses SGLang's ``TritonAttnBackend``, so its
``init_forward_metadata``, CUDA-graph state and capture/replay methods run unchanged (the
engine's per-step host work and the metadata kernels are counted); ``forward_decode`` and
``forward_extend`` return zeros shaped like the real output (``[num_tokens, tp_q_head_num *
v_head_dim]`` in the query's dtype) and never call ``set_kv_buffer``: no KV is read or written
and nothing is computed. The KV pool is the model runner's own, as for every backend.

``kvfloor`` (:func:`kv_floor_class`) is the bound plus the step's distinct KV read once per
layer (``tools/kv_floor.py``): every token a request of the step reaches, once, from the
layer's K and V buffers. No exact attention backend reads less.

``prefixfloor`` (:func:`floor_class`) is the same backend plus one cost: each decode forward
runs the shared prefix's attention math, and nothing else, on FA3 (vLLM's build where it is
importable, else sgl_kernel's; ``tools/prefix_floor.fa3_varlen``), the fastest dense
attention kernel these engines ship for Hopper: every query of the batch against a fixed
P-token K/V of the layer's KV heads (``tools/prefix_floor.py``). Any exact attention computes
at least that product, so on the ``shared1:P`` workload no backend whose prefix math is not
faster than FA3's beats this step.

Registration (:func:`register`) adds ``noattn`` to SGLang's backend choices
(``add_attention_backend_choices``) and its factory to ``ATTENTION_BACKENDS``
(``register_attention_backend``). SGLang spawns its scheduler, which must register it too:
SGLang's ``load_plugins()`` runs every entry point of the ``sglang.srt.plugins`` group in the
launching process, the scheduler and the detokenizer. :func:`plugin_env` writes a minimal
distribution (a ``.dist-info`` folder with that entry point) into a folder and returns the
environment that puts it on ``sys.path``; the benchmark passes that environment to its bound
engine's process only, so no other SGLang process sees the backend.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

from tools.prefix_floor import check_floor_tokens

NAME = "noattn"
FLOOR = "prefixfloor"
FLOOR_TOKENS = 0
"""The prefix length of ``prefixfloor`` in this process (:func:`register_floor`)."""
ENTRY_POINT = "prefixattn_bench_noattn"
DIST = "prefixattn_bench_noattn"
FLOOR_DIST = FLOOR_MODULE = "prefixattn_bench_prefixfloor"
KV_FLOOR = "kvfloor"
KV_FLOOR_DIST = "prefixattn_bench_kvfloor"
REPO_ROOT = Path(__file__).resolve().parents[2]


@functools.cache
def backend_class() -> type:
    """The backend class (imports SGLang's triton backend: only in a model runner's process)."""
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    class NoAttnBackend(TritonAttnBackend):
        """Triton's metadata and graph paths; zeros instead of attention; no KV writes."""

        def forward_decode(
            self, q: Any, k: Any, v: Any, layer: Any, forward_batch: Any,
            save_kv_cache: bool = True, **kwargs: Any,
        ) -> Any:  # fmt: skip
            tokens = q.numel() // (layer.tp_q_head_num * layer.qk_head_dim)
            return q.new_zeros((tokens, layer.tp_q_head_num * layer.v_head_dim))

        def forward_extend(
            self, q: Any, k: Any, v: Any, layer: Any, forward_batch: Any,
            save_kv_cache: bool = True, **kwargs: Any,
        ) -> Any:  # fmt: skip
            # Inside SGLang's prefill-graph scope the caller hands the output buffer over in
            # ``forward_batch._attn_output`` (as the triton backend reads it).
            out = getattr(forward_batch, "_attn_output", None)
            if out is not None:
                return out.zero_()
            tokens = q.numel() // (layer.tp_q_head_num * layer.qk_head_dim)
            return q.new_zeros((tokens, layer.tp_q_head_num * layer.v_head_dim))

    NoAttnBackend.__module__ = __name__
    NoAttnBackend.__qualname__ = "NoAttnBackend"
    return NoAttnBackend


@functools.cache
def floor_class() -> type:
    """The ``prefixfloor`` backend class: :func:`backend_class` plus the prefix's math."""
    import torch

    from tools.prefix_floor import fa3_varlen, random_kv

    source, fa3 = fa3_varlen()

    class PrefixFloorBackend(backend_class()):  # type: ignore[misc]
        """The bound, plus FA3 over every query against ``FLOOR_TOKENS`` keys per layer."""

        def __init__(self, model_runner: Any) -> None:
            super().__init__(model_runner)
            cfg, device = model_runner.model_config, model_runner.device
            kv = random_kv(
                cfg.num_hidden_layers, FLOOR_TOKENS, self.num_kv_head,
                cfg.head_dim, model_runner.dtype, device,
            )  # fmt: skip
            self.floor_kv = [(k[0], v[0]) for k, v in kv]  # [P, KV heads, dims] per layer
            self.floor_cu_k = torch.tensor([0, FLOOR_TOKENS], dtype=torch.int32, device=device)
            self.floor_cu_q = torch.zeros(2, dtype=torch.int32, device=device)
            print(f"prefixfloor: {FLOOR_TOKENS}-token prefix, FA3 from {source}", flush=True)

        def forward_decode(
            self, q: Any, k: Any, v: Any, layer: Any, forward_batch: Any,
            save_kv_cache: bool = True, **kwargs: Any,
        ) -> Any:  # fmt: skip
            n = q.numel() // (layer.tp_q_head_num * layer.qk_head_dim)
            kc, vc = self.floor_kv[layer.layer_id]
            out = q.new_empty((n, layer.tp_q_head_num, layer.v_head_dim))
            self.floor_cu_q[1:].fill_(n)  # one kernel, captured with the step's graph
            fa3(q.reshape(n, layer.tp_q_head_num, layer.qk_head_dim), kc, vc, self.floor_cu_q,
                self.floor_cu_k, n, FLOOR_TOKENS, layer.scaling, out)  # fmt: skip
            return out.reshape(n, layer.tp_q_head_num * layer.v_head_dim)

    PrefixFloorBackend.__module__ = __name__
    PrefixFloorBackend.__qualname__ = "PrefixFloorBackend"
    return PrefixFloorBackend


@functools.cache
def kv_floor_class() -> type:
    """The ``kvfloor`` backend class: :func:`backend_class` plus the step's distinct KV read
    once per layer (``tools/kv_floor.py``; page size 1: each token a page)."""
    import torch

    from tools.kv_floor import StepPages, distinct_pages, first_reads, read_pages, sink_for

    class KvFloorBackend(backend_class()):  # type: ignore[misc]
        """The bound, plus each layer's K and V of the tokens the step's requests reach,
        each token once."""

        def __init__(self, model_runner: Any) -> None:
            super().__init__(model_runner)
            if self.sliding_window_size is not None:
                raise ValueError("kvfloor reads whole contexts; this model has a window")
            device = torch.device(model_runner.device)  # "cuda": this process's GPU
            if device.index is None:
                device = torch.device(device.type, torch.cuda.current_device())
            self.sink = sink_for(device)
            self.step_pages = StepPages()

        def _read(self, layer: Any, forward_batch: Any) -> None:
            k = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
            pages, count = self.step_pages.get(
                forward_batch,
                layer.layer_id,
                lambda: distinct_pages(*first_reads(
                    self.req_to_token[forward_batch.req_pool_indices], forward_batch.seq_lens,
                    1, k.shape[0],
                )),
            )  # fmt: skip
            v = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
            read_pages([k, v], pages, count, self.sink)

        def forward_decode(
            self, q: Any, k: Any, v: Any, layer: Any, forward_batch: Any,
            save_kv_cache: bool = True, **kwargs: Any,
        ) -> Any:  # fmt: skip
            self._read(layer, forward_batch)
            return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

        def forward_extend(
            self, q: Any, k: Any, v: Any, layer: Any, forward_batch: Any,
            save_kv_cache: bool = True, **kwargs: Any,
        ) -> Any:  # fmt: skip
            self._read(layer, forward_batch)
            return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    KvFloorBackend.__module__ = __name__
    KvFloorBackend.__qualname__ = "KvFloorBackend"
    return KvFloorBackend


def _mha_only(model_runner: Any, name: str) -> None:
    if getattr(model_runner, "use_mla_backend", False):
        raise ValueError(f"the {name} bound serves MHA/GQA models; this model uses MLA")


def create_backend(model_runner: Any) -> Any:
    """SGLang attention-registry factory: ``fn(model_runner) -> AttentionBackend``."""
    _mha_only(model_runner, NAME)
    return backend_class()(model_runner)


def create_floor(model_runner: Any) -> Any:
    """SGLang attention-registry factory of ``prefixfloor``."""
    _mha_only(model_runner, FLOOR)
    return floor_class()(model_runner)


def create_kv_floor(model_runner: Any) -> Any:
    """SGLang attention-registry factory of ``kvfloor``."""
    _mha_only(model_runner, KV_FLOOR)
    return kv_floor_class()(model_runner)


def register() -> None:
    """Add ``noattn`` to SGLang's attention-backend choices and registry (idempotent)."""
    from prefixattn.adapters.sglang.plugin import register_backend

    register_backend(NAME, create_backend)


def register_floor(tokens: int) -> None:
    """Add ``prefixfloor`` with a ``tokens``-token prefix (idempotent)."""
    from prefixattn.adapters.sglang.plugin import register_backend

    global FLOOR_TOKENS
    FLOOR_TOKENS = check_floor_tokens(tokens)
    register_backend(FLOOR, create_floor)


def register_kv_floor() -> None:
    """Add ``kvfloor`` to SGLang's attention-backend choices and registry (idempotent)."""
    from prefixattn.adapters.sglang.plugin import register_backend

    register_backend(KV_FLOOR, create_kv_floor)


def kv_floor_plugin_env(folder: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    """As :func:`plugin_env`, for ``kvfloor`` (:func:`register_kv_floor`)."""
    return plugin_distribution(
        folder, KV_FLOOR_DIST, KV_FLOOR_DIST, f"{__name__}:register_kv_floor", base
    )


def plugin_env(folder: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    """Write a distribution whose ``sglang.srt.plugins`` entry point is :func:`register` into
    ``folder``; return ``base`` (default ``os.environ``) with ``folder`` and the repository
    root first on ``PYTHONPATH`` (importlib.metadata finds ``*.dist-info`` folders on
    ``sys.path``; spawned processes inherit it) and the entry point added to
    ``SGLANG_PLUGINS`` when that whitelist is set."""
    return plugin_distribution(folder, DIST, ENTRY_POINT, f"{__name__}:register", base)


def floor_plugin_env(
    folder: Path, tokens: int, base: dict[str, str] | None = None
) -> dict[str, str]:
    """As :func:`plugin_env`, for ``prefixfloor`` with a ``tokens``-token prefix: the entry
    point is a written module that calls :func:`register_floor` with it."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{FLOOR_MODULE}.py").write_text(
        f"from tools.sglang.noattn import register_floor\n\n\n"
        f"def register() -> None:\n    register_floor({check_floor_tokens(tokens)})\n"
    )
    return plugin_distribution(folder, FLOOR_DIST, FLOOR_DIST, f"{FLOOR_MODULE}:register", base)


def plugin_distribution(
    folder: Path, dist: str, entry_point: str, target: str, base: dict[str, str] | None = None
) -> dict[str, str]:
    """A minimal distribution ``dist`` in ``folder`` whose ``sglang.srt.plugins`` entry point
    ``entry_point`` is ``target`` (``module:function``), and the environment that finds it
    (see :func:`plugin_env`)."""
    info = folder / f"{dist}-0.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text(f"[sglang.srt.plugins]\n{entry_point} = {target}\n")
    env = dict(os.environ if base is None else base)
    paths = [str(folder), str(REPO_ROOT)] + [p for p in [env.get("PYTHONPATH", "")] if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    if env.get("SGLANG_PLUGINS"):
        env["SGLANG_PLUGINS"] = f"{env['SGLANG_PLUGINS']},{entry_point}"
    return env
