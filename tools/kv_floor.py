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
is in use (inside the request's length) and not used by an earlier slot, and
:func:`distinct_pages` packs those pages to the front of an array with their count on the
device: fixed shapes and no host sync, so both run under CUDA graph capture. Per layer,
:func:`read_pages` reads each of the counted pages once with a Triton kernel whose few
programs stride over them (the count bounds its loop on the device), adding what they read
into a sink so that no load can be left out. The pages' contents do not matter (the bound
writes none). The floor is for full attention: a sliding window reads less.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
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


def distinct_pages(pages: torch.Tensor, first: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The pages ``first`` marks, packed to the front of an int64 array of ``pages``' length
    plus one (the rest is unspecified), and their count (int64 [1]), both on the device
    without a host sync: the read then costs the distinct pages, not the table's slots."""
    n = pages.numel()
    at = torch.cumsum(first, 0) - 1
    packed = torch.zeros(n + 1, dtype=torch.int64, device=pages.device)
    packed.scatter_(0, torch.where(first, at, n), pages)
    count = (at[-1:] + 1) if n else torch.zeros(1, dtype=torch.int64, device=pages.device)
    return packed, count


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def read_pages_kernel(
        a_ptr, b_ptr, pages_ptr, count_ptr, sink_ptr, page_stride,
        PAGE: tl.constexpr, CHUNK: tl.constexpr, TWO: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        # Each program takes BLOCK pages at a time: BLOCK x CHUNK elements per load, so that
        # small pages (SGLang's one-token pages) still keep enough bytes in flight.
        pid = tl.program_id(0)
        step = tl.num_programs(0) * BLOCK
        acc = tl.zeros([BLOCK, CHUNK], dtype=tl.float32)
        offs = tl.arange(0, CHUNK)
        rows = tl.arange(0, BLOCK)
        n = tl.load(count_ptr)
        for first in range(pid * BLOCK, n, step):
            at = first + rows
            live = at < n
            base = tl.load(pages_ptr + at, mask=live, other=0) * page_stride
            for off in range(0, PAGE, CHUNK):
                ptrs = base[:, None] + off + offs[None, :]
                acc += tl.load(a_ptr + ptrs, mask=live[:, None], other=0.0).to(tl.float32)
                if TWO:
                    acc += tl.load(b_ptr + ptrs, mask=live[:, None], other=0.0).to(tl.float32)
        tl.atomic_add(sink_ptr + pid, tl.sum(acc))

    return read_pages_kernel


# Elements one program loads at a time (BLOCK pages of CHUNK elements). At 4096, SGLang's
# one-token pages of 8 x 128 elements go 4 at a time (72 registers a thread for sm_90a, so
# the 4 programs per SM of `sink_for` all stay resident), and vLLM's 16-token pages one at a
# time in chunks of 4096, as before (56 registers). At 8192, 168 registers: 3 programs per SM.
LOAD_ELEMENTS = 4096


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill one gap-free span of memory (in some order of dims)."""
    expected = 1
    for size, stride in sorted((d for d in zip(t.shape, t.stride(), strict=True) if d[0] != 1),
                               key=lambda d: d[1]):  # fmt: skip
        if stride != expected:
            return False
        expected *= size
    return True


def read_pages(
    planes: list[torch.Tensor],
    pages: torch.Tensor,
    count: torch.Tensor,
    sink: torch.Tensor,
    block: int | None = None,
) -> None:
    """Read the first ``count`` pages listed in ``pages`` (from :func:`distinct_pages`) once
    from each plane: one or two tensors ``[num_pages, ...]`` of one shape and strides (K and
    V apart, or one plane whose pages hold both) whose pages ``plane[p]`` each fill a
    gap-free span of memory; their sum goes into ``sink`` (float32 on the device, one entry
    per program: its length sets the programs). Other planes raise ``ValueError``.
    ``block``: pages a program loads at once (a power of two; default: as many as make
    :data:`LOAD_ELEMENTS` elements)."""
    if not 1 <= len(planes) <= 2:
        raise ValueError(f"kv floor: one or two KV planes, got {len(planes)}")
    a, b = planes[0], planes[-1]
    if a.shape != b.shape or a.stride() != b.stride():
        raise ValueError(
            f"kv floor: planes {tuple(a.shape)} / {a.stride()} and {tuple(b.shape)} / "
            f"{b.stride()} differ"
        )
    page = a[0].numel()
    if not _dense(a[0]) or a.stride(0) < page:
        raise ValueError("kv floor: a KV page does not fill one span of the cache's memory")
    chunk = min(4096, page & -page)  # the largest power of two dividing the page, at most 4K
    block = LOAD_ELEMENTS // chunk if block is None else block
    if block < 1 or block & (block - 1):
        raise ValueError(f"kv floor: block {block} is not a power of two")
    _kernel()[(sink.numel(),)](
        a, b, pages, count, sink, a.stride(0),
        PAGE=page, CHUNK=chunk, TWO=len(planes) == 2, BLOCK=block,
    )  # fmt: skip


class StepPages:
    """A step's pages to read (:func:`distinct_pages`), found once per step, at its first
    layer: a forward starts again at a lower layer index, or with another ``step`` object.
    The layer order is what counts: SGLang reuses one batch object for a decode graph's
    warm-up runs and its capture, so the object alone does not mark a new step."""

    def __init__(self) -> None:
        self.step: object = None
        self.layer = -1
        self.found: tuple[torch.Tensor, torch.Tensor] | None = None

    def get(
        self,
        step: object,
        layer: int,
        find: Callable[[], tuple[torch.Tensor, torch.Tensor]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The pages and count of ``step``'s ``layer``; ``find()`` (first_reads, then
        distinct_pages) where this layer starts a step."""
        if self.found is None or step is not self.step or layer <= self.layer:
            self.found = find()
            self.step = step
        self.layer = layer
        return self.found


def sink_for(device: torch.device) -> torch.Tensor:
    """A sink with four programs per SM of ``device``."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return torch.zeros(4 * sms, dtype=torch.float32, device=device)


def bench(
    tokens: int,
    page_tokens: int,
    *,
    kv_heads: int = 8,
    head_dim: int = 128,
    layers: int = 8,
    reps: int = 10,
    blocks: tuple[int | None, ...] = (1, None),
) -> dict[str, Any]:
    """The read's rate on this GPU: ``tokens`` distinct KV tokens (K and V, bf16) in pages of
    ``page_tokens``, scattered over a cache twice that size, read by :func:`read_pages` with
    each ``block`` (None: the default), against one ``sum`` over the same bytes laid out
    densely. ``layers`` caches take turns, so that no read hits L2. GB/s, from CUDA events
    over ``reps`` rounds of all layers."""
    dev = torch.device("cuda")
    num = -(-tokens // page_tokens)
    shape = (2 * num, page_tokens, kv_heads, head_dim)
    caches = [
        [torch.ones(shape, dtype=torch.bfloat16, device=dev) for _ in range(2)]
        for _ in range(layers)
    ]
    gen = torch.Generator(device="cpu").manual_seed(0)
    pages = torch.randperm(2 * num, generator=gen)[:num].to(dev)
    count = torch.tensor([num], dtype=torch.int64, device=dev)
    sink = sink_for(dev)
    dense = [torch.ones(2 * num * page_tokens * kv_heads * head_dim, dtype=torch.bfloat16,
                        device=dev) for _ in range(layers)]  # fmt: skip
    nbytes = dense[0].numel() * dense[0].element_size()

    def rate(read: Callable[[int], object]) -> float:
        for i in range(layers):
            read(i)  # compiles, warms up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            for i in range(layers):
                read(i)
        end.record()
        end.synchronize()
        return round(nbytes * reps * layers / (start.elapsed_time(end) * 1e-3) / 1e9, 1)

    out: dict[str, Any] = {
        "tokens": tokens,
        "page_tokens": page_tokens,
        "mb_per_layer": round(nbytes / 1e6, 1),
        "dense_sum_gb_s": rate(lambda i: dense[i].sum()),
    }
    for block in blocks:

        def read(i: int, block: int | None = block) -> None:
            read_pages(caches[i], pages, count, sink, block)

        out[f"read_pages_block_{block or 'default'}_gb_s"] = rate(read)
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m tools.kv_floor --tokens 53000 --page-tokens 1 16``: :func:`bench`, one JSON
    line per page size."""
    import argparse
    import json

    ap = argparse.ArgumentParser(description="The KV floor's read rate on this GPU")
    ap.add_argument("--tokens", type=int, default=53248, help="distinct KV tokens per layer")
    ap.add_argument("--page-tokens", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--blocks", type=int, nargs="+", default=[1, 0], help="0: the default")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    blocks = tuple(b or None for b in args.blocks)
    for pt in args.page_tokens:
        print(json.dumps(bench(args.tokens, pt, reps=args.reps, blocks=blocks)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
