"""The launch plan: what the forward and merge stages execute for one decode/extend step.

A plan depends only on the block table, the sequence lengths and the query lengths, never on
the layer, so it is built once per step (on the host) and reused by every layer.

Vocabulary
----------
- *token*: one row of ``q`` ([T, Hq, D]); tokens of request ``b`` are rows
  ``qo_indptr[b] .. qo_indptr[b+1]-1``.
- *position*: index of a KV entry inside its request's sequence, ``0 .. seq_len-1``.
- *work item* (PAT's "CTA"): a run of KV pages (positions ``kv_start .. kv_start+kv_len-1``)
  and the tokens that all attend to it. The kernel runs one thread block per
  (work item, KV head); its query tile holds ``len(tokens) * group_size`` rows
  (token-major, heads of one KV group contiguous).
- *partial*: one row ``[Hq, D]`` of normalised output (the CUDA kernels and the reference
  store it in the input dtype) plus ``[Hq]`` fp32
  log-sum-exp (natural log of the sum of ``exp(scale * q.k)``), written by a work item
  for a token that other work items also cover. A token covered by exactly one work item
  is written straight to the output in the input dtype and never merged.

Worked example (page_size 2, two requests sharing pages 7 and 3, one query each)::

    block_table = [[7, 3, 5],      seq_lens = [6, 5]
                   [7, 3, 9]]
    forest: root  pages [7, 3]  positions 0..3  requests {0, 1}
              ├── leaf pages [5]  positions 4..5  request 0
              └── leaf pages [9]  positions 4..4  request 1
    packing="naive": 3 work items; token 0 is covered by items 0 and 1, token 1 by
    items 0 and 2, so 4 partial rows and 2 merged tokens.

All integer arrays are int32 (numpy on the host in ``host``; torch tensors on the plan's
device as attributes). On a CUDA device the tensors are views of buffers owned by the
``PrefixAttention`` that built the plan: they keep their addresses across plans (for CUDA
graphs) and are overwritten by its next ``plan()`` call. They are ordered by tile group: items ``tile_indptr[t] ..
tile_indptr[t+1]-1`` all use tile ``tiles[t]``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

    from .forest import PrefixForest


@dataclasses.dataclass(frozen=True)
class PlanArrays:
    """Host (numpy, int32) copy of every index array of a :class:`LaunchPlan`.

    Field meanings are those of the same-named :class:`LaunchPlan` fields.
    """

    kv_page_offset: np.ndarray
    kv_pages: np.ndarray
    kv_start: np.ndarray
    kv_len: np.ndarray
    q_indptr: np.ndarray
    q_tokens: np.ndarray
    q_limit: np.ndarray
    q_out: np.ndarray
    tile_id: np.ndarray
    tile_indptr: np.ndarray
    merge_tokens: np.ndarray
    merge_indptr: np.ndarray
    merge_partials: np.ndarray


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    """Everything the forward and merge stages need for one step (all layers).

    Work-item arrays (W = ``num_work_items``), int32 tensors on ``device``:

    kv_page_offset: [W]
        Item ``w`` reads pages ``kv_pages[kv_page_offset[w] :][: ceil(kv_len[w] / page_size)]``.
        Items may share stored pages: the pages read from one block-table row are stored once
        per run of columns (a chunked prefill's row chunks read the same context), so ``P``
        is at most the block table's used entries.
    kv_pages: [P]
        Physical page ids (rows of the KV cache's page dimension).
    kv_start: [W]
        Position of the first KV entry of item ``w`` (a multiple of ``page_size``).
    kv_len: [W]
        Number of KV entries item ``w`` reads, starting at its first page's first slot.
    q_indptr: [W+1]
        Item ``w`` serves query slots ``q_indptr[w] : q_indptr[w+1]``.
    q_tokens: [Q]
        For each query slot, the token (row of ``q``) it computes.
    q_limit: [Q]
        For each query slot, the causal bound: the token attends to positions ``< q_limit``.
        A decode token has ``q_limit = seq_len``; token ``i`` of ``n`` new tokens of a request
        of length ``L`` has ``q_limit = L - n + i + 1``. Slots whose bound would exclude the
        whole item are never emitted.
    q_out: [Q]
        For each query slot, the partial row it writes, or -1 when the slot is the token's
        only one (the item then writes the final output directly), or ``-2 - (16 * j + n)``
        when the slot's leaf item finishes its token (``num_finished``): it merges the
        token's ``n`` other partial rows ``merge_partials[j - n : j]`` itself, or, when the
        launcher does not let it, writes row ``merge_partials[j]``.
    tile_id: [W]
        Index into ``tiles`` of the (m, n) tile the item runs with.
    merge_tokens: [M]
        Tokens covered by more than one item (the only ones the merge stage touches); the last
        ``num_finished`` are finished by the leaf launch.
    merge_indptr: [M+1], merge_partials: [num_partials]
        Token ``merge_tokens[i]`` merges partial rows
        ``merge_partials[merge_indptr[i] : merge_indptr[i+1]]``.

    Host-side values (Python ints/tuples; reading them never syncs a device):

    tile_indptr
        Tile groups: items ``tile_indptr[t] .. tile_indptr[t+1]-1`` use ``tiles[t]``.
    num_ctas
        (work item, KV head) pairs of the forward stage: ``num_work_items * num_kv_heads``
        (the 16-row kernel may run several KV heads of an item as one pair,
        ``counts[PACKED_HEADS]``).
    kv_bytes
        Bytes of K and V the forward stage reads from global memory in one call (one layer),
        counting repeated reads of a shared page by several work items.
    partial_bytes
        Bytes of partial output (input dtype) and fp32 log-sum-exp written by the forward
        stage and read back by the merge stage in one call.
    distinct_kv_bytes
        Bytes of K and V of the distinct KV entries the batch attends to: what an ideal kernel
        reads once.
    query_centric_kv_bytes
        Bytes of K and V a query-centric kernel (each request reads its whole KV) reads.
    qo_bytes
        Bytes of q read and output written.
    """

    # Shapes and configuration.
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    kv_layout: str
    packing: str
    split_kv: bool
    batch_size: int
    num_tokens: int
    num_work_items: int
    num_partials: int
    num_merge_tokens: int
    max_page_id: int
    """Largest page id the plan reads; -1 when not known on the host
    (:meth:`PrefixAttention.plan_unshared`)."""
    tiles: tuple[tuple[int, int], ...]
    tile_indptr: tuple[int, ...]
    # Accounting (bytes, one layer).
    num_ctas: int
    kv_bytes: int
    partial_bytes: int
    distinct_kv_bytes: int
    query_centric_kv_bytes: int
    qo_bytes: int
    # Device arrays.
    device: torch.device
    kv_page_offset: torch.Tensor
    kv_pages: torch.Tensor
    kv_start: torch.Tensor
    kv_len: torch.Tensor
    q_indptr: torch.Tensor
    q_tokens: torch.Tensor
    q_limit: torch.Tensor
    q_out: torch.Tensor
    tile_id: torch.Tensor
    merge_tokens: torch.Tensor
    merge_indptr: torch.Tensor
    merge_partials: torch.Tensor
    counts: torch.Tensor
    """int32 [``COUNTS_LEN``] on ``device``: the plan's sizes (num_work_items, num_slots,
    num_pages, num_merge_tokens, num_partials, num_tokens), the item bounds of each kernel
    variant, the packed KV heads and the merge launch's tokens (``prefixattn.plan.layout``),
    for kernels launched with a fixed grid (CUDA graphs) that read them from device memory."""
    # Host copies and the forest the plan came from.
    host: PlanArrays
    forest: PrefixForest
    # Hinted plans (:meth:`PrefixAttention.plan_hinted`).
    fallback: LaunchPlan | None = None
    """The per-request plan that runs instead of this one when the device check of the hint
    fails; None for other plans."""
    fallback_taken: torch.Tensor | None = None
    """bool scalar on ``device``: the check failed (``fallback`` runs, this plan's ``counts``
    were zeroed); None for other plans."""
    num_finished: int = 0
    """Merged tokens the leaf launch finishes (the last ``num_finished`` of
    ``merge_tokens``; see ``prefixattn.plan.packing.finish_in_leaf``): their leaf slot has
    ``q_out <= -2``, and the merge launch takes the others."""
    leaf_max_rows: int = -1
    """The most query rows (tokens x GQA group) of an item of the 16-row tile group (0 when
    the group is empty; -1: not known). The leaf kernel runs a narrower form, with fewer
    registers, when it is at most 8."""
    leaf_tiles: int = -1
    """The 16-token tiles of the 16-row tile group's items, summed (-1: not known). Where they
    average at most 3 per item, the leaf kernel's narrow form runs more warps per SM, each a
    tile ahead."""
    narrow: bool = False
    """The plan took the tile table's narrow alternative (``TileTable.narrow``: no 128-row
    tiles), which moved at most ``TileTable.narrow_traffic`` times the bytes."""
    lineage: object = dataclasses.field(default=None, compare=False, repr=False)
    """The same object for plans advanced from one another in a decode run (their shared
    work items are the same); None where not known."""

    @property
    def total_bytes(self) -> int:
        """Bytes the plan moves through global memory per layer: KV + partials + q/out."""
        return self.kv_bytes + self.partial_bytes + self.qo_bytes

    def summary(self) -> str:
        """One line: items, CTAs, tile groups and bytes."""
        groups = ", ".join(
            f"{m}x{n}:{self.tile_indptr[i + 1] - self.tile_indptr[i]}"
            for i, (m, n) in enumerate(self.tiles)
        )
        return (
            f"packing={self.packing} items={self.num_work_items} ctas={self.num_ctas} "
            f"tiles[{groups}] kv={self.kv_bytes / 1e6:.2f}MB "
            f"partials={self.partial_bytes / 1e6:.2f}MB "
            f"(distinct kv {self.distinct_kv_bytes / 1e6:.2f}MB, "
            f"query-centric {self.query_centric_kv_bytes / 1e6:.2f}MB)"
        )
