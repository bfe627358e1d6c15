"""SGLang attention backend: SGLang's batch metadata and KV pool in, the core's plan/run out.

SGLang keeps one token per slot by default (``page_size`` 1): ``req_to_token[r, i]`` is the
slot of request ``r``'s token ``i``, and ``k_buffer[layer]`` is ``[size + page_size, Hkv, D]``.
The radix cache rewrites the rows of requests that share a prefix to the same leading slots,
so the rows themselves describe the sharing. This module views the pool as an NHD paged cache
``[num_pages, page_size, Hkv, D]`` (a view, no copy) and turns the batch's rows into a block
table of page ids; the core finds the shared prefixes and does the attention.

Worked example, page_size 4, two requests sharing their first 8 tokens::

    req_to_token[r0, :10] = [8 9 10 11 12 13 14 15 40 41]
    req_to_token[r1, :9]  = [8 9 10 11 12 13 14 15 60]
    block_table = rows[:, ::4] // 4 = [[2, 3, 10], [2, 3, 15]]    (pages 2, 3 shared)

SGLang allocates whole pages per request, so a row's slots inside one page are consecutive
and its first slot in each page is page-aligned.

One plan per step; every layer's ``forward_*`` reuses it. Which plan method a step uses (from
the device rows without waiting, or from a host copy of them) is decided by the core's
:class:`~prefixattn.engine.step.StepPlanner`. Eager steps plan on
:attr:`PrefixAttnBackend.core`; decode steps that SGLang runs as CUDA graphs plan on
:attr:`PrefixAttnBackend.graph_core`, whose device buffers are reserved once for the largest
captured batch, so an eager prefill never moves the buffers the captured kernels read.

Works with SGLang 0.5.17 through 0.5.23. Refused at start-up: a CUDA device without the
compiled CUDA kernels (attention would silently run on the PyTorch reference) and SGLang's
metadata glue graph (``SGLANG_ENABLE_METADATA_GLUE_GRAPH``, 0.5.19+), which would capture the
host-built plan of one step and replay it for later ones.

Options (:class:`~prefixattn.engine.step.StepOptions`): SGLang has no per-backend settings, so
the backend takes ``options`` as a constructor argument, default
:func:`prefixattn.engine.step.default_options` (set them with
:func:`prefixattn.engine.step.configure` in the scheduler processes, for example from a plugin
of the ``sglang.srt.plugins`` group, which SGLang loads in each of them).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.runtime_context import get_parallel
from torch.profiler import record_function

from prefixattn import CapturedBuffers, PrefixAttention, decode_reservation
from prefixattn.engine.step import (
    StepOptions,
    StepPlanner,
    cuda_graphs_available,
    kernels_unavailable_reason,
)

logger = logging.getLogger("prefixattn")

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    from prefixattn import LaunchPlan


def core_supports_cuda_graphs() -> bool:
    """Whether the installed core's ``run`` may be captured in a CUDA graph and replayed with
    later plans.

    That needs the compiled CUDA kernels and launches whose shape does not depend on the plan
    (the core says so with ``PrefixAttention.cuda_graph_safe``). Without them, ``run`` either
    executes the PyTorch reference, which reads the plan on the host, or launches grids sized
    by the capture-time plan, which a replay would reuse for a different batch.
    """
    return cuda_graphs_available()


GLUE_GRAPH_ENV = "SGLANG_ENABLE_METADATA_GLUE_GRAPH"
"""SGLang 0.5.19+: capture ``init_forward_metadata_out_graph`` into a CUDA graph and replay
only its device work (refused: this backend's plan is host work of every step)."""

TABLE_WIDTH_STEP = 256
"""Pages by which the width of a step's device table grows (see ``_batch_tables``)."""


def metadata_glue_graph_enabled() -> bool:
    """Is SGLang's metadata glue graph switched on (False where SGLang has none)?"""
    try:
        from sglang.srt.environ import envs
    except ImportError:
        return False
    flag = getattr(envs, GLUE_GRAPH_ENV, None)
    return flag is not None and bool(flag.get())


GRAPH_REMEDY = (
    "Restart with a smaller --cuda-graph-max-bs-decode or with --disable-decode-cuda-graph."
)


def graph_reservation(
    max_bs: int, max_num_tokens: int, max_context_len: int, page_size: int, spare_slots: int
) -> dict[str, int]:
    """Plan sizes reserved for decode graphs of up to ``max_bs`` requests (one new token
    each, KV length at most ``max_context_len``): the core's :func:`decode_reservation`
    with ``spare_slots`` (``StepPlanner.spare_slots``). A deeper forest than it allows for
    is refused at plan time (see :meth:`PrefixAttnBackend.init_forward_metadata_out_graph`)."""
    return decode_reservation(
        max_bs, max_num_tokens, max_context_len, page_size, spare_slots=spare_slots
    )


def _refuse_extras(layer: RadixAttention, kwargs: dict[str, Any]) -> None:
    """Arguments some models pass for features this backend does not implement (attention
    sinks, score modifiers, FP8 descales, ...): refused by name rather than ignored."""
    extras = sorted(k for k, v in kwargs.items() if v is not None and v is not False)
    if extras:
        raise NotImplementedError(
            f"prefixattn: layer {layer.layer_id} passes {', '.join(extras)}, which this "
            "backend does not implement"
        )


@dataclass
class ForwardMetadata:
    """What one step's layers share."""

    plan: LaunchPlan
    """The step's launch plan (one for all layers)."""
    num_tokens: int
    """Query rows the plan covers; rows of q beyond it are padding."""
    core: PrefixAttention
    """The core that built the plan (it owns the plan's buffers and scratch)."""


def _pdmux_enabled(model_runner: Any) -> bool:
    """Is SGLang's prefill-decode multiplexing on (0.5.23: the runtime context's disaggregation
    settings; earlier: the server arguments)?"""
    try:
        from sglang.srt.runtime_context import get_disagg

        if getattr(get_disagg(), "enable_pdmux", False):
            return True
    except (ImportError, AttributeError, KeyError, RuntimeError, ValueError):
        pass  # no runtime context (SGLang < 0.5.19, or its settings not published here)
    return bool(getattr(getattr(model_runner, "server_args", None), "enable_pdmux", False))


def new_delegate_backend(model_runner: Any) -> Any:
    """SGLang's ``flashinfer`` backend over the same pools, for the steps prefixattn gains
    nothing on (``StepOptions.delegate_unshared``); None where it cannot be made here.

    It takes SGLang's shared flashinfer workspace (384 MiB, 512 MiB for some models), which
    SGLang's memory sizing does not count for this backend. Not under prefill-decode
    multiplexing (``--enable-pdmux``), whose prefill and decode backends run at once and need
    workspaces of their own."""
    if _pdmux_enabled(model_runner):
        logger.warning(
            "prefixattn: no steps on SGLang's flashinfer backend under --enable-pdmux (the "
            "two attention backends would share one flashinfer workspace)"
        )
        return None
    try:
        from sglang.srt.layers.attention.flashinfer_backend import FlashInferAttnBackend

        return FlashInferAttnBackend(model_runner)
    except Exception as e:  # an import or set-up failure only costs the delegation
        logger.warning(
            "prefixattn: SGLang's flashinfer backend is not available (%s: %s); steps without "
            "sharing are planned unshared instead",
            type(e).__name__,
            e,
        )
        return None


class PrefixAttnBackend(AttentionBackend):
    """``--attention-backend prefixattn``: prefix-aware paged attention for MHA/GQA models.

    Serves decode, extend (prefill with a cached prefix) and mixed chunked-prefill batches
    with one plan per step. Refuses what it does not implement (sliding windows, logit
    caps, cross attention, different K and V head sizes) with an error naming the layer.
    """

    def __init__(self, model_runner: Any, options: StepOptions | None = None) -> None:
        super().__init__()
        config = model_runner.model_config
        tp = get_parallel().attn_tp_size
        self.device = torch.device(model_runner.device)
        missing = kernels_unavailable_reason(self.device)
        if missing is not None:
            raise RuntimeError(missing)
        if metadata_glue_graph_enabled():
            raise ValueError(
                f"prefixattn: {GLUE_GRAPH_ENV} is set, but this backend builds each step's plan "
                "on the host: a glued metadata graph would replay the plan captured for an "
                f"earlier step (wrong attention, silently). Unset {GLUE_GRAPH_ENV}."
            )
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.page_size = int(model_runner.page_size)
        self.num_qo_heads = config.get_num_attention_heads(tp)
        self.num_kv_heads = config.get_num_kv_heads(tp)
        self.head_dim = int(config.head_dim)
        self.dtype = model_runner.kv_cache_dtype
        if self.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            raise ValueError(
                f"prefixattn: KV cache dtype {self.dtype} is not supported "
                "(use --kv-cache-dtype auto with a float16/bfloat16 model)"
            )
        layout = getattr(self.token_to_kv_pool, "kv_cache_layout", "nhd")
        if layout != "nhd":
            raise ValueError(
                f"prefixattn: KV pool layout {layout!r} is not supported (the token-major NHD "
                "pool only; unset SGLANG_USE_HND_KVCACHE)"
            )
        spec = getattr(model_runner, "spec_algorithm", None)
        if spec is not None and spec.is_speculative():
            raise ValueError("prefixattn: speculative decoding is not supported in SGLang yet")
        server_args = getattr(model_runner, "server_args", None)
        if getattr(server_args, "dllm_algorithm", None) is not None:
            raise ValueError("prefixattn: diffusion language models are not supported")
        self.planner = StepPlanner(
            self._new_core, self.page_size, options=options, remedy=GRAPH_REMEDY
        )
        """Which plan method each step uses, and the eager/graph pair of cores."""
        self.graph_reserved: dict[str, int] | None = None
        self.forward_metadata: ForwardMetadata | None = None
        self.delegating = False
        """The step runs on :attr:`delegate_backend` (with its own metadata)."""
        self.delegate_backend: Any = None
        """SGLang's ``flashinfer`` backend, which runs the eager steps that the planner
        expects to share nothing (``StepOptions.delegate_unshared``) and extend batches of new
        requests (``delegate_prefills``); None: prefixattn plans every step."""
        options = self.planner.options
        if (
            (options.delegate_unshared or options.delegate_prefills)
            and self.device.type == "cuda"
            and self.dtype in (torch.float16, torch.bfloat16)
        ):
            self.delegate_backend = new_delegate_backend(model_runner)
        if self.delegate_backend is not None:
            # SGLang's flashinfer autotune sizes its dummy extend batch by this: within the
            # request pool, as flashinfer's buffers are.
            self.extend_dummy_seqs_capped_by_req_pool = True

    @property
    def core(self) -> PrefixAttention:
        """Plans the eager steps."""
        return self.planner.eager_attention

    @property
    def graph_core(self) -> PrefixAttention | None:
        """Plans the decode steps SGLang runs as CUDA graphs (created by
        :meth:`init_cuda_graph_state`); eager steps never touch its buffers."""
        return self.planner.graph_attention

    @property
    def graph_buffers(self) -> CapturedBuffers:
        """The :attr:`graph_core` buffers the captured decode graphs read."""
        return self.planner.captured

    def _new_core(self) -> PrefixAttention:
        """A core for this model's attention shape and SGLang's NHD token-major KV pool."""
        return PrefixAttention(
            self.num_qo_heads,
            self.num_kv_heads,
            self.head_dim,
            self.page_size,
            kv_layout="NHD",
            device=self.device,
            dtype=self.dtype,
        )

    # ------------------------------------------------------------------ metadata
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Eager steps (prefill, mixed, decode batches that run without a graph, the warm-up
        forward, attention inside breakable prefill graphs): plan on :attr:`core`."""
        self.delegating = False
        if forward_batch.forward_mode.is_idle():
            self.forward_metadata = None
            return
        self.forward_metadata = self._plan(self.core, forward_batch)

    def init_forward_metadata_out_graph(
        self, forward_batch: ForwardBatch, in_capture: bool = False
    ) -> None:
        """Decode CUDA graphs: SGLang calls this outside the graph, before capturing each
        batch size (``in_capture=True``, a batch of padding rows) and before every replay
        (a view of the padded batch: padding rows have ``req_pool_indices`` 0 and
        ``seq_lens`` equal to :meth:`get_cuda_graph_seq_len_fill_value`).

        The plan covers the padded batch, so it has exactly the captured number of query
        rows, and lands in :attr:`graph_core`'s reserved device buffers, where the captured
        kernels read it. A plan that would have moved those buffers is refused: the graphs
        would read freed memory.
        """
        core = self.graph_core
        if core is None:
            raise RuntimeError(
                "prefixattn: init_forward_metadata_out_graph before init_cuda_graph_state"
            )
        mode = forward_batch.forward_mode
        if not mode.is_decode():
            raise NotImplementedError(
                f"prefixattn: CUDA graphs that capture attention in {mode.name} batches are "
                "not supported (decode graphs are; prefill graphs only with the default "
                "'breakable' backend, which runs attention outside the graph)"
            )
        self.delegating = False
        meta = self._plan(core, forward_batch, capture=in_capture)
        assert meta is not None  # graph steps are never delegated
        self.planner.check()
        self.forward_metadata = meta

    def init_forward_metadata_in_graph(self, forward_batch: ForwardBatch) -> None:
        """Nothing to record: the plan's device arrays are written before replay."""

    def _plan(
        self, core: PrefixAttention, forward_batch: ForwardBatch, capture: bool = False
    ) -> ForwardMetadata | None:
        """The step's plan on ``core``; None for a step given to :attr:`delegate_backend`
        (which then sets :attr:`delegating`)."""
        bs = forward_batch.batch_size
        # Graph replays pad the batch at its end (rows of request 0): leave those out.
        real = bs - int(getattr(forward_batch, "num_padding", 0) or 0)
        # Extend batches hold the new requests' prefills alone: they do not teach the
        # planner the running requests' sharing (StepPlanner.teaches).
        prefill_only = forward_batch.forward_mode == ForwardMode.EXTEND
        choice = self.planner.choose(
            real,
            decode=forward_batch.forward_mode.is_decode(),
            capture=capture,
            graph=core is not self.core,
            delegate=self.delegate_backend is not None,
            prefill_only=prefill_only,
        )
        if choice.kind == "delegated":
            # The flashinfer backend runs the step; the planner only looks at its rows.
            with record_function("prefixattn.plan"):
                rows, seq_lens, _ = self._batch_tables(forward_batch, on_host=False)
            self.planner.delegated(rows, seq_lens, num_real=real, prefill_only=prefill_only)
            self.delegate_backend.init_forward_metadata(forward_batch)
            self.delegating = True
            return None
        if choice.device_table:
            # The page ids are gathered on the device (no wait); the planner looks at this
            # batch on the side.
            with record_function("prefixattn.plan"):
                rows, seq_lens, qo_indptr = self._batch_tables(forward_batch, on_host=False)
            plan = self.planner.plan_device(
                core, choice, rows, seq_lens, qo_indptr, num_real=real, prefill_only=prefill_only
            )
        else:
            # Named ranges for profiles (tools' trace summary): the copy of the batch's rows
            # to the host waits for the work queued before it.
            with record_function("prefixattn.host_tables"):
                block_table, seq_lens, qo_indptr = self._batch_tables(forward_batch)
            plan = self.planner.plan_host(
                core, block_table, seq_lens, qo_indptr, num_real=real, capture=capture,
                prefill_only=prefill_only,
            )  # fmt: skip
        return ForwardMetadata(plan, plan.num_tokens, core)

    def _batch_tables(
        self, forward_batch: ForwardBatch, on_host: bool = True
    ) -> tuple[Any, np.ndarray, np.ndarray | None]:
        """Block table [B, pages] (on the host, or with ``on_host=False`` an int32 tensor on
        the pool's device), seq_lens [B] and qo_indptr [B+1] (None for decode) on the host."""
        bs = forward_batch.batch_size
        seq_lens_cpu = forward_batch.seq_lens_cpu
        if seq_lens_cpu is None or seq_lens_cpu.shape[0] < bs:
            seq_lens_cpu = forward_batch.seq_lens[:bs].cpu()
        seq_lens = seq_lens_cpu[:bs].numpy().astype(np.int32)
        max_len = int(seq_lens.max(initial=0))
        max_len = max(max_len, 1)
        ps = self.page_size
        req = forward_batch.req_pool_indices[:bs]
        # One gather (and for a host table one device-to-host copy) of the batch's rows; with
        # page_size > 1 only the first slot of each page travels. A device table is gathered
        # TABLE_WIDTH_STEP pages wider at a time, so the steps of a decode run see one table
        # shape and advance the previous step's plan (PrefixAttention) instead of planning
        # afresh; the extra columns are never read.
        pool = self.req_to_token_pool.req_to_token
        end = max_len
        if not on_host:
            pages = -(-max_len // ps)
            pages = -(-pages // TABLE_WIDTH_STEP) * TABLE_WIDTH_STEP
            end = min(pages * ps, pool.shape[1])
        rows = pool[req, :end:ps]
        block_table: Any
        if on_host:
            block_table = rows.cpu().numpy()
            if ps > 1:  # slot -> page id (a page's slots are consecutive, its first aligned)
                block_table = block_table // ps
            block_table = block_table.astype(np.int32, copy=False)
        else:
            block_table = (rows // ps if ps > 1 else rows).to(torch.int32).contiguous()

        mode = forward_batch.forward_mode
        if mode.is_decode():
            qo_indptr = None
        elif mode.name in ("EXTEND", "MIXED"):
            extend_lens = forward_batch.extend_seq_lens_cpu
            if extend_lens is None:
                extend_lens = forward_batch.extend_seq_lens[:bs].cpu().tolist()
            qo_indptr = np.zeros(bs + 1, dtype=np.int32)
            np.cumsum(np.asarray(extend_lens[:bs], dtype=np.int64), out=qo_indptr[1:])
        else:
            raise NotImplementedError(
                f"prefixattn: forward mode {mode.name} is not supported "
                "(decode, extend and mixed are)"
            )
        return block_table, seq_lens, qo_indptr

    # ---------------------------------------------------------------- CUDA graphs
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Create :attr:`graph_core` and reserve its device buffers for the largest captured
        decode batch (:func:`graph_reservation`).

        SGLang calls this once, before capturing; every captured batch size reads its plan
        from the same buffers, which the step's plan is written into before each replay.
        """
        if self.device.type == "cuda" and not core_supports_cuda_graphs():
            raise RuntimeError(
                "prefixattn: this installation's attention cannot be replayed from a CUDA graph "
                "across steps (it needs the compiled CUDA kernels with plan-independent "
                "launches); start SGLang with --disable-decode-cuda-graph (or "
                "--disable-cuda-graph)"
            )
        max_context = int(self.req_to_token_pool.req_to_token.shape[1])
        self.graph_reserved = self.planner.reserve_graphs(max_bs, max_num_tokens, max_context)
        self.graph_buffers.remedy = f"(Reserved: {self.graph_reserved}.) {GRAPH_REMEDY}"
        self.planner.pin()

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """Padding rows get KV length 1: SGLang points them at ``req_to_token`` row 0 (its
        padding row, all zeros) and writes their K/V to slot 0 (never allocated to a
        request), so each attends to slot 0 only. That is a valid one-token plan entry, it
        shares no page with real requests, and its output is discarded."""
        return 1

    # ------------------------------------------------------------------ forward
    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        **kwargs: Any,
    ) -> torch.Tensor:
        _refuse_extras(layer, kwargs)
        if self.delegating:
            return self.delegate_backend.forward_decode(
                q, k, v, layer, forward_batch, save_kv_cache
            )
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache)

    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        **kwargs: Any,
    ) -> torch.Tensor:
        _refuse_extras(layer, kwargs)
        if self.delegating:
            return self.delegate_backend.forward_extend(
                q, k, v, layer, forward_batch, save_kv_cache
            )
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache)

    def _forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool,
    ) -> torch.Tensor:
        """q: [T, Hq*D] (or [T, Hq, D]); k, v: [T, Hkv, D]; returns [T, Hq*D]."""
        self._check_layer(layer)
        if not save_kv_cache and k is not None and v is not None:
            raise NotImplementedError(
                f"prefixattn: layer {layer.layer_id} passes new K/V without saving them "
                "(save_kv_cache=False); attention reads K/V from the pool only"
            )
        if getattr(forward_batch, "encoder_lens", None) is not None:
            raise NotImplementedError("prefixattn: encoder-decoder models are not supported")
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(
                layer, KVWriteLoc(forward_batch.out_cache_loc), k, v
            )
        meta = self.forward_metadata
        if meta is None:
            raise RuntimeError("prefixattn: forward called before init_forward_metadata")
        hq, d = layer.tp_q_head_num, layer.qk_head_dim
        q3 = q.reshape(-1, hq, d)
        out = q.new_empty(q3.shape[0], hq * layer.v_head_dim)
        out3 = out.view(-1, hq, layer.v_head_dim)
        n = meta.num_tokens
        if q3.shape[0] > n:
            # Rows past the plan are padding (padded token counts); their output is unused.
            out3[n:].zero_()
        shape = (-1, self.page_size, layer.tp_k_head_num, d)
        k_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id).view(shape)
        v_cache = self.token_to_kv_pool.get_value_buffer(layer.layer_id).view(shape)
        meta.core.run(q3[:n], k_cache, v_cache, scale=layer.scaling, out=out3[:n], plan=meta.plan)
        return out

    def _check_layer(self, layer: RadixAttention) -> None:
        reasons = []
        if getattr(layer, "is_cross_attention", False):
            reasons.append("cross attention")
        attn_type = getattr(layer, "attn_type", None)
        if attn_type is not None and getattr(attn_type, "value", attn_type) != "decoder":
            # Encoder-only and bidirectional layers are not causal; the plan is.
            reasons.append(f"attention type {getattr(attn_type, 'value', attn_type)}")
        if getattr(layer, "xai_temperature_len", -1) > 0:
            reasons.append(f"xai temperature scaling (len {layer.xai_temperature_len})")
        if layer.sliding_window_size is not None and layer.sliding_window_size > -1:
            reasons.append(f"sliding window {layer.sliding_window_size}")
        if layer.logit_cap and layer.logit_cap > 0:
            reasons.append(f"logit cap {layer.logit_cap}")
        if layer.qk_head_dim != layer.v_head_dim:
            reasons.append(f"K head size {layer.qk_head_dim} != V head size {layer.v_head_dim}")
        if (layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim) != (
            self.num_qo_heads,
            self.num_kv_heads,
            self.head_dim,
        ):
            reasons.append(
                f"heads/head_dim ({layer.tp_q_head_num}, {layer.tp_k_head_num}, "
                f"{layer.qk_head_dim}) differ from the model's ({self.num_qo_heads}, "
                f"{self.num_kv_heads}, {self.head_dim})"
            )
        if reasons:
            raise NotImplementedError(
                f"prefixattn: layer {layer.layer_id} is not supported: " + "; ".join(reasons)
            )
