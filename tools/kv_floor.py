"""The KV-read floor in an engine: the attention-free bound plus each step's distinct KV, read once.

Exact attention reads every KV page its queries see at least once per layer and step, however
it shares the reads. The floor backends (vLLM: ``KVFLOOR``, ``tools/vllm/noattn.py``; the
serving benchmark's ``readfloor``) are the bound (the engine's metadata path, no KV written,
no math) plus exactly that read: every layer reads each distinct page of the step's block
table once, and nothing else. Their throughput is the most any exact attention backend can
reach on the same traffic; a backend that also does the math and the KV writes can only be
slower. (The prefill math, which the floor leaves out, makes the real limit lower still: the
floor is an upper bound on every backend's percent of the bound.)

Per step, :func:`first_reads` marks each (request, page slot) of the block table whose page
is in use (inside the request's length) and not used by an earlier slot, with device ops of
fixed shapes (no host sync, so it runs under CUDA graph capture); per layer,
:func:`read_pages` reads the marked pages of the layer's K and V planes with a Triton kernel
whose few programs stride over the slots, and adds what they read into a sink, so that no
load can be left out. The pages' contents do not matter (the bound writes none).
"""

from __future__ import annotations

import functools
from typing import Any

import torch


def first_reads(
    block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int, num_pages: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Page ids (``block_table`` flattened, int64; slots not in use point at ``num_pages``)
    and a bool mask of the slots to read: in use (column < ceil(length / block_size)) and the
    first in use with its page. ``block_table``: [R, W] page ids; ``seq_lens``: [R] (rows of
    length 0, such as an engine's graph padding, read nothing). Worked example, block_size 16:
    rows [[3, 4, 9], [3, 5, 8]] of lengths 40 and 20 use pages 3, 4, 9 and 3, 5: the slots
    read are (0, 0), (0, 1), (0, 2) and (1, 1)."""
    if block_table.dim() != 2 or seq_lens.dim() != 1 or seq_lens.shape[0] > block_table.shape[0]:
        raise ValueError(
            f"kv floor: block table {tuple(block_table.shape)} and lengths "
            f"{tuple(seq_lens.shape)} are not [R, W] and [R' <= R]"
        )
    if block_size < 1 or num_pages < 1:
        raise ValueError(f"kv floor: block_size {block_size}, num_pages {num_pages} must be > 0")
    rows = seq_lens.shape[0]
    table = block_table[:rows].to(torch.int64)
    used_cols = (seq_lens.to(torch.int64) + block_size - 1) // block_size
    cols = torch.arange(table.shape[1], device=table.device)
    in_use = cols[None, :] < used_cols[:, None]
    pages = torch.where(in_use, table, num_pages).flatten()
    slots = torch.arange(pages.numel(), device=table.device)
    owner = torch.full((num_pages + 1,), pages.numel(), dtype=torch.int64, device=table.device)
    owner.scatter_reduce_(0, pages, slots, reduce="amin")
    first = in_use.flatten() & (owner[pages] == slots)
    return pages, first


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def read_pages_kernel(
        k_ptr, v_ptr, pages_ptr, first_ptr, sink_ptr, n_slots, page_stride,
        PAGE: tl.constexpr, CHUNK: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        acc = tl.zeros([CHUNK], dtype=tl.float32)
        offs = tl.arange(0, CHUNK)
        for s in range(pid, n_slots, tl.num_programs(0)):
            if tl.load(first_ptr + s) != 0:
                base = tl.load(pages_ptr + s) * page_stride
                for off in range(0, PAGE, CHUNK):
                    k = tl.load(k_ptr + base + off + offs)
                    v = tl.load(v_ptr + base + off + offs)
                    acc += k.to(tl.float32) + v.to(tl.float32)
        tl.atomic_add(sink_ptr + pid, tl.sum(acc, axis=0))

    return read_pages_kernel


def read_pages(
    k_plane: torch.Tensor,
    v_plane: torch.Tensor,
    pages: torch.Tensor,
    first: torch.Tensor,
    sink: torch.Tensor,
) -> None:
    """Read the pages of ``k_plane`` and ``v_plane`` ([num_pages, ...], each page contiguous)
    that ``first`` marks (``pages``, ``first``: from :func:`first_reads`) once each, adding
    their sum into ``sink`` (float32 on the device, one entry per program: its length sets
    the programs). Pages whose K or V are not contiguous, or planes of different shapes,
    raise ``ValueError``."""
    if k_plane.shape != v_plane.shape or k_plane.stride() != v_plane.stride():
        raise ValueError(
            f"kv floor: K {tuple(k_plane.shape)} / {k_plane.stride()} and V "
            f"{tuple(v_plane.shape)} / {v_plane.stride()} planes differ"
        )
    page = k_plane[0].numel()
    if not (k_plane[0].is_contiguous() and v_plane[0].is_contiguous()):
        raise ValueError("kv floor: a KV page is not contiguous in the cache's layout")
    chunk = min(4096, 1 << (page.bit_length() - 1))
    if page % chunk:
        raise ValueError(f"kv floor: page of {page} elements is not a multiple of {chunk}")
    _kernel()[(sink.numel(),)](
        k_plane, v_plane, pages, first.view(torch.uint8), sink, pages.numel(), k_plane.stride(0),
        PAGE=page, CHUNK=chunk,
    )  # fmt: skip


def sink_for(device: torch.device) -> torch.Tensor:
    """A sink with four programs per SM of ``device``."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return torch.zeros(4 * sms, dtype=torch.float32, device=device)
