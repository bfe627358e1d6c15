"""The KV-read floor (``tools/kv_floor.py``): which block-table slots it reads (CPU), the read
kernel (GPU, with Triton), and the serving benchmark's ``readfloor`` backend."""

from __future__ import annotations

import pytest
import torch

from tools import kv_floor
from tools.serving import bench


def _reads(table: list[list[int]], lens: list[int], block_size: int, pages: int) -> list[tuple]:
    t = torch.tensor(table, dtype=torch.int32)
    ids, first = kv_floor.first_reads(t, torch.tensor(lens, dtype=torch.int32), block_size, pages)
    width = t.shape[1]
    return [(int(s) // width, int(s) % width, int(ids[s])) for s in torch.nonzero(first).flatten()]


def test_first_reads_marks_each_page_in_use_once() -> None:
    # The docstring's example: pages 3, 4, 9 and 3, 5 in use; page 3 read by its first slot.
    assert _reads([[3, 4, 9], [3, 5, 8]], [40, 20], 16, 10) == [
        (0, 0, 3), (0, 1, 4), (0, 2, 9), (1, 1, 5),
    ]  # fmt: skip
    # A page first used by a later row is read there; pages past a row's length are not
    # read (row 1's page 7), nor rows of length 0 (graph padding), nor rows the lengths lack.
    assert _reads([[5, 6], [2, 7], [6, 6], [1, 1]], [16, 1, 0], 16, 8) == [
        (0, 0, 5), (1, 0, 2),
    ]  # fmt: skip
    # Page size 1 (SGLang-like): every token its own page.
    assert _reads([[0, 1, 2, 3], [0, 1, 4, 5]], [4, 3], 1, 6) == [
        (0, 0, 0), (0, 1, 1), (0, 2, 2), (0, 3, 3), (1, 2, 4),
    ]  # fmt: skip


def test_first_reads_match_a_set_on_random_tables() -> None:
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        rows, width, pages, bs = 9, 7, 30, 4
        table = torch.randint(0, pages, (rows, width), generator=gen, dtype=torch.int32)
        lens = torch.randint(0, width * bs + 1, (rows,), generator=gen, dtype=torch.int32)
        ids, first = kv_floor.first_reads(table, lens, bs, pages)
        expected = {int(table[r, c]) for r in range(rows) for c in range(-(-int(lens[r]) // bs))}
        read = [int(p) for p in ids[first]]
        assert sorted(read) == sorted(expected) and len(read) == len(set(read))


@pytest.mark.parametrize(
    ("table", "lens", "bs", "pages", "message"),
    [
        (torch.zeros(4, dtype=torch.int32), torch.zeros(4), 16, 8, "not \\[R, W\\]"),
        (torch.zeros(2, 3, dtype=torch.int32), torch.zeros(3), 16, 8, "not \\[R, W\\]"),
        (torch.zeros(2, 3, dtype=torch.int32), torch.zeros(2), 0, 8, "must be > 0"),
    ],
)
def test_first_reads_refuses_bad_shapes(table, lens, bs, pages, message) -> None:
    with pytest.raises(ValueError, match=message):
        kv_floor.first_reads(table, lens, bs, pages)


def test_readfloor_runs_only_when_named() -> None:
    assert "readfloor" not in bench.parse_args(["--engine", "vllm"]).backends
    args = bench.parse_args(["--engine", "vllm", "--backends", "readfloor", "prefixattn", "bound"])
    assert args.backends == ["bound", "readfloor", "prefixattn"]
    args = bench.parse_args(["--engine", "sglang", "--backends", "triton", "readfloor"])
    assert (
        args.backends == ["triton", "readfloor"]
        and "readfloor" not in bench.parse_args(["--engine", "sglang"]).backends
    )


def test_sglang_readfloor_gets_its_plugin(tmp_path) -> None:
    """SGLang's scheduler is spawned: the floor reaches it through its own plugin."""
    import os
    from importlib.metadata import distributions

    args = bench.parse_args(["--engine", "sglang", "--backends", "readfloor"])
    env = bench.worker_env(args, "readfloor", tmp_path)
    folder = tmp_path / "kvfloor-plugin"
    assert str(folder) in env["PYTHONPATH"].split(os.pathsep)
    (dist,) = distributions(path=[str(folder)])
    assert dist.name == "prefixattn_bench_kvfloor"
    (ep,) = dist.entry_points
    assert ep.value == "tools.sglang.noattn:register_kv_floor"


@pytest.mark.gpu
def test_read_pages_reads_each_marked_page_once() -> None:
    """Pages hold their own index in every element: the sink's total says which pages the
    kernel read, and how often."""
    pytest.importorskip("triton")
    dev = torch.device("cuda")
    pages, bs, heads, dims = 64, 16, 8, 128
    k = torch.arange(pages, device=dev, dtype=torch.float32)[:, None, None, None].expand(
        pages, bs, heads, dims).to(torch.bfloat16).contiguous()  # fmt: skip
    v = k.clone()
    table = torch.tensor([[3, 4, 9, 0], [3, 5, 8, 0], [9, 9, 9, 9]], dtype=torch.int32, device=dev)
    lens = torch.tensor([40, 20, 64], dtype=torch.int32, device=dev)
    ids, first = kv_floor.first_reads(table, lens, bs, pages)
    sink = kv_floor.sink_for(dev)
    kv_floor.read_pages(k, v, ids, first, sink)
    per_page = 2 * bs * heads * dims  # K and V
    assert float(sink.sum()) == pytest.approx((3 + 4 + 9 + 5) * per_page, rel=1e-6)
    with pytest.raises(ValueError, match="not contiguous"):
        kv_floor.read_pages(k.transpose(1, 2), v.transpose(1, 2), ids, first, sink)


def test_vllm_kv_floor_backend() -> None:
    pytest.importorskip("vllm")
    import types

    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from tools.vllm import noattn

    noattn.register_kv_floor()
    noattn.register_kv_floor()
    assert AttentionBackendEnum[noattn.KV_FLOOR].get_class() is noattn.KvFloorBackend
    assert noattn.KvFloorBackend.get_impl_cls() is noattn.KvFloorImpl
    assert issubclass(noattn.KvFloorBackend, noattn.NoAttentionBackend)
    impl = object.__new__(noattn.KvFloorImpl)  # the constructor allocates on a GPU
    out = torch.ones(5, 4, 8)
    # vLLM's memory-profiling forward (no metadata): zeros, as the bound.
    assert impl.forward(None, out, out, out, None, None, output=out) is out
    assert not out.any()
    meta = types.SimpleNamespace(
        block_table=torch.zeros(2, 3, dtype=torch.int32), seq_lens=torch.ones(2)
    )
    with pytest.raises(ValueError, match="not FLASH_ATTN's"):
        impl.forward(None, out, out, out, torch.zeros(4, 16, 8, 8), meta, output=out)


def test_sglang_kv_floor_backend() -> None:
    pytest.importorskip("sglang")
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    from tools.sglang import noattn

    noattn.register_kv_floor()
    noattn.register_kv_floor()
    assert ATTENTION_BACKENDS[noattn.KV_FLOOR] is noattn.create_kv_floor
    assert issubclass(noattn.kv_floor_class(), noattn.backend_class())
