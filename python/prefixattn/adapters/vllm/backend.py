"""vLLM attention backend (vLLM 0.26 through 0.33): vLLM's paged KV cache and batch metadata in,
prefixattn out.

Four parts, as vLLM's own backends have them:

- :class:`PrefixAttentionBackend`: what the backend supports and how its KV cache is laid out.
- :class:`PrefixAttentionMetadata`: the step's plan, shared by every layer.
- :class:`PrefixAttentionMetadataBuilder`: one plan per step from ``CommonAttentionMetadata``,
  through the core's :class:`~prefixattn.engine.step.StepPlanner` (which plan method, the
  graph/eager pair).
- :class:`PrefixAttentionImpl`: writes new K/V into the cache and calls
  :meth:`PrefixAttention.run` per layer.

Prefix sharing needs nothing from vLLM beyond prefix caching (on by default): requests with a
common prefix have identical leading block ids in ``block_table_tensor``, which the core's plan
turns into work items that read each shared block once. Every request of a step (decodes,
prefill and extend chunks, speculative verification with several query tokens) goes through the
same causal plan.

KV cache: logical shape ``(num_blocks, num_kv_heads, block_size, 2 * head_size)`` with K in the
first and V in the second half of the last dimension. vLLM 0.26-0.28 ask the backend for it
(``get_kv_cache_shape``, stride order ``(0, 2, 1, 3)``: in memory ``[num_blocks, block_size,
num_kv_heads, 2 * head_size]``); vLLM 0.29+ resolve one ``KVCacheLayout`` for the model from
what every backend supports (:meth:`PrefixAttentionBackend.supported_kv_cache_layouts`: tokens
before heads first). The K and V halves are NHD views with a contiguous last dimension, which
the core reads in place with any strides.

Options (:class:`~prefixattn.engine.step.StepOptions`): vLLM's own
``additional_config={"prefixattn": {"hinted_plans": False, ...}}`` (``--additional-config``),
which reaches every worker process.

Start-up: on a CUDA device without the compiled CUDA kernels the backend refuses to run
(:meth:`PrefixAttentionBackend.validate_configuration` names the reason) rather than run the
PyTorch reference.

Steps on vLLM's own kernel (``StepOptions.delegate_unshared`` / ``delegate_prefills``, off by
default; :mod:`.delegate`): the builder may return ``FLASH_ATTN``'s metadata for a whole step,
or a plan with ``FLASH_ATTN``'s metadata for the step's prefill chunks beside it
(:attr:`PrefixAttentionMetadata.prefill`); the impl runs those rows on ``FLASH_ATTN``'s impl.

CUDA graphs: with the compiled CUDA kernels loaded and a core that declares
``PrefixAttention.cuda_graph_safe``, the builder reports ``AttentionCGSupport.UNIFORM_BATCH``
(vLLM's default ``FULL_AND_PIECEWISE`` mode then captures full graphs for uniform decode
batches, including speculative verification, and piecewise graphs for the rest); otherwise
``NEVER``. A captured ``PrefixAttention.run`` reads every size from the plan's device buffers,
so each replay executes the plan that the step's ``build`` wrote into the same buffers. See
:class:`PrefixAttentionMetadataBuilder` for the reservation, the padding and the stale-buffer
check.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from torch.profiler import record_function
from vllm.config import CUDAGraphMode
from vllm.platforms import current_platform
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.attention.backends.utils import get_num_attention_heads_from_layers

from prefixattn import CapturedBuffers, LaunchPlan, PrefixAttention
from prefixattn.attention import DECODE_DEPTH_ALLOWANCE, MAX_PAGE_SIZE
from prefixattn.engine.step import (
    StepOptions,
    StepPlanner,
    cuda_graphs_available,
    default_options,
    graph_slots_per_token,
    kernels_unavailable_reason,
)
from prefixattn.plan.tiles import SUPPORTED_HEAD_DIMS
from prefixattn.runtime import library

from . import delegate

try:  # vLLM >= 0.29: one KV cache layout for the model, resolved across its backends
    from vllm.v1.kv_cache_layout import KVCacheLayout
except ImportError:  # vLLM 0.26-0.28: get_kv_cache_shape / get_kv_cache_stride_order
    KVCacheLayout = None

OPTIONS_KEY = "prefixattn"
"""Key of this backend's :class:`StepOptions` in vLLM's ``additional_config``."""

NAMED_KV_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
"""vLLM's ``kv_cache_dtype`` names that fix the cache's dtype ("auto": the model's)."""


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
    def get_supported_kernel_block_sizes(kv_cache_spec: Any = None) -> list[int | MultipleOf]:
        # Any page size from 1 to MAX_PAGE_SIZE, listed one by one: a larger KV-manager block
        # (hybrid models) is then split into the largest of them that divides it. vLLM 0.32+
        # pass the spec, earlier releases nothing.
        return list(range(MAX_PAGE_SIZE, 0, -1))

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[Any, ...] | None:
        """vLLM 0.29+: every per-layer cache is a logical ``(blocks, heads, tokens, 2 * D)``
        view whose K/V halves the core reads with any strides. Tokens before heads (NHD)
        first, the layout the kernels are tuned for; layer-outermost first, since only it lets
        vLLM split a large KV-manager block into kernel blocks."""
        if KVCacheLayout is None:
            return None
        return (KVCacheLayout.LBNHC, KVCacheLayout.BLNHC)

    @classmethod
    def supports_device_cpu_query_lens_mismatch(cls) -> bool:
        # Plans are built from query_start_loc_cpu: with device-trimmed drafts (adaptive
        # verification, vLLM 0.28+) they would cover the wrong rows, so vLLM must refuse us.
        return False

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
        if use_mm_prefix:
            return "bidirectional multimodal prefixes not supported (attention is causal)"
        named = NAMED_KV_DTYPES.get(str(kv_cache_dtype))
        if named is not None and named != dtype:
            return f"kv_cache_dtype {kv_cache_dtype} differs from the model dtype {dtype}"
        return None

    @classmethod
    def supports_compute_capability(cls, capability: Any) -> bool:
        # The CUDA kernels are built for sm_90a. Without them validate_configuration refuses
        # CUDA devices for that reason instead.
        if capability is None or not _kernels_built():
            return True
        return (capability.major, capability.minor) == (9, 0)

    @classmethod
    def validate_configuration(cls, *args: Any, **kwargs: Any) -> list[str]:
        """vLLM's checks, plus: a CUDA device (vLLM passes its compute capability) needs the
        compiled CUDA kernels."""
        reasons = list(super().validate_configuration(*args, **kwargs))
        bound = inspect.signature(super().validate_configuration).bind(*args, **kwargs)
        if bound.arguments.get("device_capability") is not None:
            missing = kernels_unavailable_reason("cuda")
            if missing is not None:
                reasons.append(missing)
        return reasons


NULL_BLOCK = 0
"""vLLM's null block (``NULL_BLOCK_ID``): never given to a request, always a valid page id.
Padding tokens of a full-graph batch attend to its first slot."""

GRAPH_DEPTH_ALLOWANCE = DECODE_DEPTH_ALLOWANCE
"""Prefix levels per request that the CUDA-graph reservation allows for (the core's)."""


def _with_padding(
    lens: np.ndarray, qsl: np.ndarray, b: int, pad: int
) -> tuple[np.ndarray, np.ndarray]:
    """``seq_lens`` and ``qo_indptr`` of the ``b`` real requests plus ``pad`` tokens beyond the
    last one (full-graph padding): one request each, of length 1, so the plan covers every row
    the captured run reads."""
    n_real = int(qsl[b])
    lens = np.concatenate([lens, np.ones(pad, np.int32)])
    indptr = np.concatenate([qsl[: b + 1], n_real + np.arange(1, pad + 1, dtype=np.int32)])
    return lens, indptr


def _requests_after(
    cm: CommonAttentionMetadata, start: int, b: int, host_lens: torch.Tensor
) -> CommonAttentionMetadata:
    """``cm`` of requests ``start:b`` alone (their tokens from ``query_start_loc[start]`` on,
    with any padding after them): FLASH_ATTN's input for an eager step's prefill chunks."""
    qsl_cpu = cm.query_start_loc_cpu[start : b + 1]
    first = int(qsl_cpu[0])
    q_lens = qsl_cpu[1:] - qsl_cpu[:-1]
    changes: dict[str, Any] = dict(
        query_start_loc=cm.query_start_loc[start : b + 1] - first,
        query_start_loc_cpu=qsl_cpu - first,
        seq_lens=cm.seq_lens[start:b],
        num_reqs=b - start,
        num_actual_tokens=cm.num_actual_tokens - first,
        max_query_len=int(q_lens.max()),
        max_seq_len=int(host_lens[start:b].max()),
        block_table_tensor=cm.block_table_tensor[start:b],
        slot_mapping=cm.slot_mapping[first:],
        seq_lens_cpu_upper_bound=host_lens[start:b],
    )
    # Every other per-request or per-token field describes the whole batch: sliced where it
    # is the tokens' positions, else its default (as vLLM's own request slices have them).
    for f in dataclasses.fields(cm):
        if f.name in changes or f.name == "causal" or not f.init:
            continue
        if f.name == "positions" and cm.positions is not None:
            changes["positions"] = cm.positions[first:]
        elif f.default is not dataclasses.MISSING:
            changes[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            changes[f.name] = f.default_factory()
    return dataclasses.replace(cm, **changes)


def _kernels_built() -> bool:
    try:
        return bool(library.cuda_ops_available())
    except (OSError, RuntimeError):
        return False


def step_options(vllm_config: Any) -> StepOptions:
    """The process defaults updated with ``additional_config["prefixattn"]`` (a mapping of
    :class:`StepOptions` fields; unknown names and wrong values raise)."""
    extra = getattr(vllm_config, "additional_config", None)
    ours = extra.get(OPTIONS_KEY) if isinstance(extra, Mapping) else None
    if ours is None:
        return default_options()
    if not isinstance(ours, Mapping):
        raise TypeError(
            f"additional_config[{OPTIONS_KEY!r}] must be a mapping of StepOptions fields, "
            f"got {ours!r}"
        )
    return default_options().updated(ours)


def _engine_on_cuda() -> bool:
    """Does vLLM run this process's model on a CUDA device?"""
    return bool(current_platform.is_cuda_alike())


def _model_dtype() -> torch.dtype | None:
    """The dtype of the model vLLM is building (None outside vLLM's config context)."""
    try:
        from vllm.config import get_current_vllm_config_or_none
    except ImportError:
        return None
    config = get_current_vllm_config_or_none()
    model = getattr(config, "model_config", None)
    dtype = getattr(model, "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else None


def _capturing(t: torch.Tensor) -> bool:
    """Is ``t``'s device stream being captured into a CUDA graph right now?"""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def _remedy(slots_per_token: int) -> str:
    return (
        "Reserve more (additional_config={'prefixattn': {'graph_slots_per_token': S}}, now "
        f"{slots_per_token}) or run without full CUDA graphs: enforce_eager=True, or "
        "compilation_config={'cudagraph_mode': 'PIECEWISE'}."
    )


@dataclass
class PrefixAttentionMetadata(AttentionMetadata):
    """The step's attention metadata, built once and read by every layer."""

    attention: PrefixAttention
    """The object that built ``plan`` (owns its device buffers)."""
    plan: LaunchPlan
    """The step's launch plan: rows ``0:plan.num_tokens`` of the query."""
    num_tokens: int
    """Rows of the query the plan covers: ``query_start_loc[num_reqs]``, or
    ``num_actual_tokens`` for a batch planned for full CUDA graphs (padding included)."""
    num_actual_tokens: int
    """vLLM's token count for the step (may include padding beyond the real tokens)."""
    slot_mapping: torch.Tensor
    """int64 [num_actual_tokens]; cache slot (block_id * block_size + offset) of each new token,
    -1 for padding."""
    graph: CapturedBuffers | None = None
    """Set when the plan lives in the buffers captured graphs read (graph-eligible batches)."""
    prefill: Any = None
    """``FLASH_ATTN``'s metadata for the step's prefill chunks, rows ``num_tokens:`` of the
    query (:meth:`PrefixAttentionMetadataBuilder.prefill_split`), or None."""


class PrefixAttentionMetadataBuilder(AttentionMetadataBuilder[PrefixAttentionMetadata]):
    """Builds one plan per step from ``block_table_tensor``, ``seq_lens`` and ``query_start_loc``.

    The plan is host work (prefix forest, packing, tile choice). Its inputs on the host:
    ``query_start_loc_cpu`` (vLLM's own host copy); ``seq_lens_cpu_upper_bound`` (vLLM's host
    copy of the lengths, exact unless speculative decoding makes it optimistic: then, and when
    vLLM gives none, ``seq_lens`` is copied from the device); the block table rows, which exist
    only on the device, so every step copies ``num_reqs`` rows (only the columns the longest
    sequence uses) to the host: one device-to-host copy per step, not per layer, and it waits
    for the work queued before it. :attr:`planner` (the core's
    :class:`~prefixattn.engine.step.StepPlanner`) avoids that copy where it can: steps after
    one without sharing, and decode steps with a host copy of an earlier step's table, are
    planned from the device table (exact host lengths needed: not with speculative decoding).

    CUDA graphs (:meth:`get_cudagraph_support`): ``UNIFORM_BATCH`` when
    :func:`cuda_graphs_available`, else ``NEVER``. With full graphs on, the builder

    - reserves, in ``__init__``, the plan buffers and the partials of its
      ``PrefixAttention`` for the largest captured batch (``T`` tokens: vLLM's
      ``max_cudagraph_capture_size`` capped at ``max_num_seqs`` times the decode query length;
      ``S * T`` work items and query slots plus ``StepPlanner.spare_slots``, ``S`` from
      ``prefixattn.engine.step.graph_slots_per_token`` (the ``graph_slots_per_token`` option,
      else the core's); every request's pages up to ``max_model_len``);
    - plans graph-eligible batches (at most ``T`` tokens, no request with more new tokens than
      a decode or speculative verification has) into those buffers, covering all
      ``num_actual_tokens`` rows: vLLM pads a full-graph batch with requests that have no new
      token (length 0, block-table row of zeros), which are dropped, and with tokens that belong
      to no request, which become one-token requests of length 1 on vLLM's null block (their
      output rows are padding that vLLM discards);
    - leaves graph batches of one decode token (one request: nothing to share) to FLASH_ATTN
      where steps without sharing go to it (:meth:`single_request_graph`): its kernels are
      captured into those graphs and replayed;
    - plans every other batch (prefill chunks, larger batches: never replayed from a full graph)
      with a second ``PrefixAttention``, so their plans cannot make the first one's buffers move;
    - raises ``RuntimeError`` when a graph-eligible plan made the reserved buffers grow after
      graphs were captured (they would replay reading freed buffers).
    """

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER
    """Static default; vLLM asks :meth:`get_cudagraph_support`, which decides at run time."""
    reorder_batch_threshold: int | None = None

    @classmethod
    def get_cudagraph_support(cls, vllm_config: Any, kv_cache_spec: Any) -> AttentionCGSupport:
        """``UNIFORM_BATCH`` when captured runs are possible here, else ``NEVER``.

        Not ``ALWAYS``: a mixed batch's plan (prefill chunks attend to long spans of KV through
        many work items) has no useful bound in terms of its token count, so its buffers could
        outgrow any reservation made before capture. Uniform batches (decodes, speculative
        verification with equal query lengths) stay within the reservation.
        """
        if getattr(kv_cache_spec, "dtype", None) not in (torch.float16, torch.bfloat16):
            return AttentionCGSupport.NEVER
        if not cuda_graphs_available():
            return AttentionCGSupport.NEVER
        return AttentionCGSupport.UNIFORM_BATCH

    def __init__(
        self,
        kv_cache_spec: Any,
        layer_names: list[str],
        vllm_config: Any,
        device: torch.device,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        model_config = vllm_config.model_config
        # This group's own layers (a draft model's, or a model whose layers differ), else
        # the model's.
        self.num_qo_heads = get_num_attention_heads_from_layers(
            vllm_config, layer_names
        ) or model_config.get_num_attention_heads(vllm_config.parallel_config)
        self.num_kv_heads = kv_cache_spec.num_kv_heads
        self.head_dim = kv_cache_spec.head_size
        self.block_size = kv_cache_spec.block_size
        missing = kernels_unavailable_reason(device)
        if missing is not None:
            raise RuntimeError(missing)

        spec = getattr(vllm_config, "speculative_config", None)
        k = int(getattr(vllm_config, "num_speculative_tokens", 0) or 0)
        self.decode_query_len = 1 + (2 if getattr(spec, "parallel_drafting", False) else 1) * k
        """Most new tokens a request of a graph-eligible batch has (1 + speculative tokens)."""
        self.exact_host_seq_lens = spec is None
        """``seq_lens_cpu_upper_bound`` equals ``seq_lens`` (no speculative decoding)."""

        scheduler = vllm_config.scheduler_config
        compilation = vllm_config.compilation_config
        mode = compilation.cudagraph_mode
        self.full_graphs = (
            mode is not None
            and mode.decode_mode() == CUDAGraphMode.FULL
            and self.get_cudagraph_support(vllm_config, kv_cache_spec) != AttentionCGSupport.NEVER
        )
        """Full CUDA graphs may be captured over this builder's plans."""
        max_decode_tokens = scheduler.max_num_seqs * self.decode_query_len
        max_capture = compilation.max_cudagraph_capture_size or max_decode_tokens
        self.max_graph_tokens = min(max_capture, max_decode_tokens)
        """``T``: tokens of the largest batch vLLM may replay from a full graph."""
        self.max_model_len = model_config.max_model_len
        options = step_options(vllm_config)
        self.slots_per_token = graph_slots_per_token(
            options, self.max_model_len, self.max_graph_tokens
        )
        """``S``: (work item, token) slots reserved per token of the largest graph."""
        self.planner = StepPlanner(
            self._new_attention,
            self.block_size,
            options=options,
            remedy=_remedy(self.slots_per_token),
        )
        """Which plan method each step uses, and the graph/eager pair of planners."""
        self.delegate_builder: Any = None
        """``FLASH_ATTN``'s builder for the steps that run on vLLM's own kernel
        (``StepOptions.delegate_unshared``, :mod:`.delegate`); None where they cannot."""
        reason = delegate.unavailable_reason(self.block_size, self.head_dim, kv_cache_spec.dtype)
        wanted = options.delegate_unshared or options.delegate_prefills
        if wanted and torch.device(device).type == "cuda" and reason is None:
            self.delegate_builder = delegate.new_builder(
                kv_cache_spec, layer_names, vllm_config, device
            )
        self.delegated_captures = 0
        """Graph captures given to ``FLASH_ATTN`` (:meth:`single_request_graph`)."""
        if self.delegate_builder is not None and options.delegate_prefills:
            # Decodes first, then prefill chunks, so the chunks are one run of rows.
            self.reorder_batch_threshold = self.decode_query_len
        if self.full_graphs:
            self.reserve_for_graphs()

    @property
    def attention(self) -> PrefixAttention:
        """Plans every batch; with full graphs on, only graph-eligible ones (fixed buffers)."""
        if self.full_graphs:
            return self.planner.attention_for(graph=True)
        return self.planner.eager_attention

    @property
    def graph(self) -> CapturedBuffers:
        """Guards the buffers that captured full graphs read."""
        return self.planner.captured

    @property
    def plan_kinds(self) -> dict[str, int]:
        """Steps planned from a host copy of their table, from lengths alone, from a hint."""
        return self.planner.plan_kinds

    def _new_attention(self) -> PrefixAttention:
        return PrefixAttention(
            self.num_qo_heads,
            self.num_kv_heads,
            self.head_dim,
            self.block_size,
            kv_layout="NHD",
            device=self.device,
            dtype=self.kv_cache_spec.dtype,
        )

    def reserve_for_graphs(self) -> None:
        """Size the graph planner's buffers for every plan of ``max_graph_tokens`` tokens."""
        # A graph batch holds at most T requests (real or padding), one token each.
        t = self.max_graph_tokens
        self.planner.reserve_graphs(t, t, self.max_model_len)

    # ------------------------------------------------------------------ build
    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> PrefixAttentionMetadata:
        return self._build(common_attn_metadata, capture=False, fast_build=fast_build)

    def build_for_cudagraph_capture(
        self, common_attn_metadata: CommonAttentionMetadata
    ) -> PrefixAttentionMetadata:
        """The capture batch (vLLM's dummy rows: length = query length, block ids from its
        persistent table) is planned like a real one, into the buffers a replay reads."""
        return self._build(common_attn_metadata, capture=True)

    def graph_eligible(self, num_tokens: int, max_query_len: int) -> bool:
        """May vLLM replay a batch of this shape from a full CUDA graph?"""
        return (
            self.full_graphs
            and num_tokens <= self.max_graph_tokens
            and max_query_len <= self.decode_query_len
        )

    def single_request_graph(self, num_tokens: int) -> bool:
        """Does vLLM run graph batches of ``num_tokens`` tokens (padded) on FLASH_ATTN? Those
        of one decode token: one request, nothing to share (``delegate_unshared``, and the
        kernel at hand; not with speculative decoding)."""
        return (
            num_tokens == 1
            and self.decode_query_len == 1
            and self.delegate_builder is not None
            and self.planner.options.delegate_unshared
        )

    def _build(
        self, cm: CommonAttentionMetadata, capture: bool, fast_build: bool = False
    ) -> PrefixAttentionMetadata:
        if cm.causal is not True:
            raise NotImplementedError("prefixattn: non-causal attention is not supported")
        qsl = cm.query_start_loc_cpu[: cm.num_reqs + 1].numpy().astype(np.int32)
        q_lens = np.diff(qsl)
        # Trailing requests with no new token are full-graph padding: drop them.
        b = int(np.flatnonzero(q_lens)[-1]) + 1 if q_lens.any() else 0
        n_real = int(qsl[b])
        max_q = int(q_lens[:b].max(initial=0))
        eligible = self.graph_eligible(cm.num_actual_tokens, max_q)
        if eligible and self.single_request_graph(cm.num_actual_tokens):
            # One request's decode shares nothing: FLASH_ATTN's kernels are captured into
            # this graph and run at every replay (decided by the padded shape alone, the
            # same at capture and replay). The batch teaches the planner nothing.
            if capture:
                self.delegated_captures += 1
            else:
                self.planner.note_delegated()
            return self.delegate_builder.build(0, cm, fast_build)
        attention = self.planner.attention_for(graph=eligible)
        host_lens = cm.seq_lens_cpu_upper_bound
        device_table = (
            self.exact_host_seq_lens
            and host_lens is not None
            and cm.block_table_tensor.dtype == torch.int32
        )
        # vLLM's model runner gives each row's request-state index (stable while the request
        # runs): hints follow requests by it. None from runners that do not.
        ids = getattr(cm, "req_idx", None)
        ids = ids[:b] if isinstance(ids, np.ndarray) and len(ids) >= b and not capture else None
        # Prefill chunks after the decodes (vLLM orders them so): FLASH_ATTN's.
        split = None if eligible or not device_table else self.prefill_split(q_lens[:b])
        planned = b if split is None else split
        choice = self.planner.choose(
            planned,
            decode=int(q_lens[:planned].max(initial=0)) <= 1,
            capture=capture,
            graph=eligible,
            device_table=device_table,
            delegate=self.delegate_builder is not None,
        )
        # The real requests' exact host lengths, where the device table can be read.
        lens_b = host_lens[:b].numpy().astype(np.int32) if device_table else None
        if choice.kind == "delegated" or split == 0:
            # vLLM's FLASH_ATTN runs the step (never a graph step: no padding); the planner
            # only looks at its rows.
            assert lens_b is not None
            self.planner.delegated(
                cm.block_table_tensor[:b], lens_b, num_real=b,
                rows=np.arange(b, dtype=np.int32), columns=self._columns(cm), ids=ids,
            )  # fmt: skip
            # The step's metadata is FLASH_ATTN's (the impl tells them apart by type).
            return self.delegate_builder.build(0, cm, fast_build)
        prefill = whole = None
        if split is not None:
            assert host_lens is not None and lens_b is not None
            prefill = self.delegate_builder.build(
                0, _requests_after(cm, split, b, host_lens[:b]), fast_build
            )
            # The planner looks at every request, the chunks' too (a later step's hint).
            whole = (cm.block_table_tensor[:b], lens_b, ids)
            b_all, b, ids = b, split, None if ids is None else ids[:split]
            n_real = int(qsl[b])
        num_tokens = max(cm.num_actual_tokens, n_real) if eligible else n_real
        pad = num_tokens - n_real
        if choice.device_table:
            assert lens_b is not None
            lens, indptr = _with_padding(lens_b[:b], qsl, b, pad)
            # Padding tokens read one slot of row 0's first block, and take no part in its
            # prefix (private).
            rows = np.concatenate([np.arange(b, dtype=np.int32), np.zeros(pad, np.int32)])
            plan = self.planner.plan_device(
                attention, choice, cm.block_table_tensor[:b], lens, indptr, num_real=b,
                rows=rows, private=np.arange(b + pad) >= b, columns=self._columns(cm), ids=ids,
                whole=whole,
            )  # fmt: skip
        else:
            # Named ranges for profiles (tools' trace summary): the copy of the block table to
            # the host waits for the work queued before it.
            with record_function("prefixattn.host_tables"):
                table, lens = self._host_table_and_lens(cm, b if whole is None else b_all)
            host_whole = None
            if whole is not None:  # the chunks' rows are looked at, not planned
                host_whole = (table, lens, whole[2])
                table, lens = table[:b], lens[:b]
            lens, indptr = _with_padding(lens, qsl, b, pad)
            # Padding requests attend to the null block.
            table = np.concatenate([table, np.full((pad, table.shape[1]), NULL_BLOCK, np.int32)])
            plan = self.planner.plan_host(
                attention, table, lens, indptr, num_real=b, capture=capture, ids=ids,
                whole=host_whole,
            )  # fmt: skip
        if eligible and not capture:
            self.planner.check()
        return PrefixAttentionMetadata(
            attention=attention,
            plan=plan,
            num_tokens=num_tokens,
            num_actual_tokens=cm.num_actual_tokens,
            slot_mapping=cm.slot_mapping,
            graph=self.planner.captured if eligible else None,
            prefill=prefill,
        )

    def prefill_split(self, q_lens: np.ndarray) -> int | None:
        """Where an eager step's prefill chunks start, for FLASH_ATTN to run them: the index of
        the first request with more new tokens than a decode has, when every request after it
        has too (vLLM puts decodes first: :attr:`reorder_batch_threshold`); None where the
        step has none, the chunks are not all after the decodes, or they stay with
        prefixattn (``StepOptions.delegate_prefills``, FLASH_ATTN at hand)."""
        if self.delegate_builder is None or not self.planner.options.delegate_prefills:
            return None
        long = q_lens > self.decode_query_len
        if not long.any():
            return None
        first = int(np.argmax(long))
        return first if bool(long[first:].all()) else None

    def _columns(self, cm: CommonAttentionMetadata) -> int:
        """Block-table columns the batch uses. Worked example: block_size 16, max_seq_len 40
        -> 3 columns."""
        width = cm.block_table_tensor.shape[1]
        return max(1, min(-(-cm.max_seq_len // self.block_size), width))

    def _host_table_and_lens(
        self, cm: CommonAttentionMetadata, b: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """int32 host copies of block-table rows ``:b`` (the columns in use) and ``seq_lens``."""
        block_table = cm.block_table_tensor[:b, : self._columns(cm)]
        host_lens = cm.seq_lens_cpu_upper_bound
        if self.exact_host_seq_lens and host_lens is not None:
            table = block_table.to("cpu", torch.int32).numpy()
            return table, host_lens[:b].numpy().astype(np.int32)
        # One device-to-host copy of both arrays.
        seq_lens = cm.seq_lens[:b].to(torch.int32)
        host = torch.cat([seq_lens.unsqueeze(1), block_table.to(torch.int32)], dim=1).cpu()
        host_np = host.numpy()
        return np.ascontiguousarray(host_np[:, 1:]), np.ascontiguousarray(host_np[:, 0])


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
        if _engine_on_cuda():
            missing = kernels_unavailable_reason("cuda")
            if missing is not None:
                raise RuntimeError(missing)
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.delegate_impl: Any = None
        """``FLASH_ATTN``'s impl of this layer, for steps the builder delegates (made where
        :func:`.delegate.unavailable_reason` allows, as the builder asks it)."""
        dtype = NAMED_KV_DTYPES.get(kv_cache_dtype)
        if dtype is None:  # "auto": the model's dtype
            dtype = _model_dtype()
        if (
            _engine_on_cuda()
            and dtype is not None
            and delegate.unavailable_reason(None, head_size, dtype) is None
        ):
            self.delegate_impl = delegate.new_impl(
                num_heads=num_heads, head_size=head_size, scale=scale,
                num_kv_heads=self.num_kv_heads, alibi_slopes=None, sliding_window=None,
                kv_cache_dtype=kv_cache_dtype, attn_type=attn_type,
                kv_sharing_target_layer_name=kv_sharing_target_layer_name,
            )  # fmt: skip

    def _split_cache(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Logical (blocks, heads, tokens, 2D) -> NHD views (blocks, tokens, heads, D) of K and V.
        k_cache, v_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
        return k_cache, v_cache

    def _on_flash_attn(self, first: int, args: tuple[Any, ...], fa_metadata: Any) -> Any:
        """FLASH_ATTN's forward over rows ``first:`` of the step (``args``: this forward's
        layer, query, key, value, kv_cache and output)."""
        if self.delegate_impl is None:
            raise RuntimeError(
                "prefixattn: rows of the step were given to vLLM's FLASH_ATTN kernel, which "
                "this layer could not set up; run with additional_config={'prefixattn': "
                "{'delegate_unshared': False, 'delegate_prefills': False}}"
            )
        layer, query, key, value, kv_cache, output = args
        if first:
            query, output = query[first:], output[first:]
            key = None if key is None else key[first:]
            value = None if value is None else value[first:]
        return self.delegate_impl.forward(layer, query, key, value, kv_cache, fa_metadata, output)

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
                layer._k_scale,
                layer._v_scale,
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
        layer: Any,
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
        args = (layer, query, key, value, kv_cache, output)
        if not isinstance(attn_metadata, PrefixAttentionMetadata):
            # FLASH_ATTN's metadata: the builder gave the step to vLLM's kernel.
            return self._on_flash_attn(0, args, attn_metadata)
        if attn_metadata.prefill is not None:  # the prefill chunks after the planned rows
            self._on_flash_attn(attn_metadata.num_tokens, args, attn_metadata.prefill)
        n = attn_metadata.num_tokens
        k_cache, v_cache = self._split_cache(kv_cache)
        out = output[:n].view(n, self.num_heads, self.head_size)
        capturing = _capturing(query)
        if capturing and attn_metadata.graph is None:
            raise RuntimeError(
                f"prefixattn: vLLM is capturing a CUDA graph over a batch of {n} tokens that "
                "the backend did not plan into its reserved buffers (not graph-eligible); "
                "run with enforce_eager=True or compilation_config={'cudagraph_mode': "
                "'PIECEWISE'}."
            )
        attn_metadata.attention.run(
            query[:n].view(n, self.num_heads, self.head_size),
            k_cache,
            v_cache,
            scale=self.scale,
            out=out,
            plan=attn_metadata.plan,
        )
        if capturing and attn_metadata.graph is not None:
            attn_metadata.graph.pin(attn_metadata.attention)
        return output
