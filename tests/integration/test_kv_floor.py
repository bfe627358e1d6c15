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


def test_distinct_pages_packs_the_marked_pages_and_counts_them() -> None:
    table = torch.tensor([[3, 4, 9], [3, 5, 8]], dtype=torch.int32)
    pages, first = kv_floor.first_reads(table, torch.tensor([40, 20]), 16, 10)
    packed, count = kv_floor.distinct_pages(pages, first)
    assert count.tolist() == [4] and packed[:4].tolist() == [3, 4, 9, 5]
    assert packed.shape == (7,) and count.dtype == torch.int64
    none = kv_floor.first_reads(table, torch.tensor([0, 0]), 16, 10)
    assert kv_floor.distinct_pages(*none)[1].tolist() == [0]


def test_pages_must_each_fill_one_span() -> None:
    cache = torch.zeros(6, 8, 16, 256)  # vLLM's [pages, kv heads, block_size, 2 x dims]
    assert kv_floor._dense(cache.transpose(1, 2)[0])  # [16, 8, 256]: one span
    assert not kv_floor._dense(cache[:, :, :, :128][0])  # K alone: gaps between rows
    assert kv_floor._dense(torch.zeros(1, 4, 1, 3)[0])
    with pytest.raises(ValueError, match="one or two"):
        kv_floor.read_pages([], torch.zeros(1), torch.zeros(1), torch.zeros(1))
    with pytest.raises(ValueError, match="differ"):
        kv_floor.read_pages([cache, cache[:5]], torch.zeros(1), torch.zeros(1), torch.zeros(1))
    with pytest.raises(ValueError, match="one span"):
        kv_floor.read_pages([cache[..., :128]], torch.zeros(1), torch.zeros(1), torch.zeros(1))
    with pytest.raises(ValueError, match="not a power of two"):
        kv_floor.read_pages([cache], torch.zeros(1), torch.zeros(1), torch.zeros(1), block=3)


@pytest.mark.gpu
@pytest.mark.parametrize("two_planes", [True, False])
def test_read_pages_reads_each_marked_page_once(two_planes: bool) -> None:
    """Pages hold their own index in every element: the sink's total says which pages the
    kernel read, and how often."""
    pytest.importorskip("triton")
    dev = torch.device("cuda")
    pages, bs, heads, dims = 64, 16, 8, 128
    k = torch.arange(pages, device=dev, dtype=torch.float32)[:, None, None, None].expand(
        pages, bs, heads, dims).to(torch.bfloat16).contiguous()  # fmt: skip
    planes = [k, k.clone()] if two_planes else [k]
    table = torch.tensor([[3, 4, 9, 0], [3, 5, 8, 0], [9, 9, 9, 9]], dtype=torch.int32, device=dev)
    lens = torch.tensor([40, 20, 64], dtype=torch.int32, device=dev)
    packed, count = kv_floor.distinct_pages(*kv_floor.first_reads(table, lens, bs, pages))
    sink = kv_floor.sink_for(dev)
    kv_floor.read_pages(planes, packed, count, sink)
    per_page = len(planes) * bs * heads * dims
    assert float(sink.sum()) == pytest.approx((3 + 4 + 9 + 5) * per_page, rel=1e-6)


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
        impl.forward(None, out, out, out, torch.zeros(2, 4, 16, 8, 8), meta, output=out)
    impl.sliding_window = (127, 0)
    with pytest.raises(ValueError, match="has a window"):
        impl.forward(None, out, out, out, torch.zeros(4, 8, 16, 16), meta, output=out)
    layer = types.SimpleNamespace(layer_name="model.layers.17.self_attn.attn")
    assert noattn._layer_index(layer) == 17 and noattn._layer_index(object()) == 0


INTERPRETED = """
import torch
from tools import kv_floor
pages, bs, heads, dims = 64, 16, 8, 128
k = torch.arange(pages, dtype=torch.float32)[:, None, None, None].expand(
    pages, bs, heads, dims).to(torch.bfloat16).contiguous()
table = torch.tensor([[3, 4, 9, 0], [3, 5, 8, 0], [9, 9, 9, 9]], dtype=torch.int32)
lens = torch.tensor([40, 20, 64], dtype=torch.int32)
packed, count = kv_floor.distinct_pages(*kv_floor.first_reads(table, lens, bs, pages))
vllm_cache = (torch.arange(pages, dtype=torch.float32)[:, None, None, None]
              .expand(pages, bs, heads, 2 * dims).contiguous().transpose(1, 2))
for planes in ([k, k.clone()], [k], [vllm_cache.transpose(1, 2)]):
    sink = torch.zeros(8)
    kv_floor.read_pages(planes, packed, count, sink)
    print(float(sink.sum()) / (len(planes) * planes[0][0].numel()))
# SGLang's pools: one token a page, [tokens, heads, dims], K and V apart; 37 rows of a table
# over 300 pages, so that the count is no multiple of the pages a program loads at once.
pool = torch.arange(300, dtype=torch.float32)[:, None, None].expand(300, 8, 128)
pool = pool.to(torch.bfloat16).contiguous()
gen = torch.Generator().manual_seed(1)
table = torch.randint(0, 300, (37, 50), generator=gen, dtype=torch.int32)
lens = torch.randint(0, 51, (37,), generator=gen, dtype=torch.int32)
packed, count = kv_floor.distinct_pages(*kv_floor.first_reads(table, lens, 1, 300))
used = {int(table[r, c]) for r in range(37) for c in range(int(lens[r]))}
for block in (1, 2, None):
    sink = torch.zeros(5)
    kv_floor.read_pages([pool, pool.clone()], packed, count, sink, block)
    print(float(sink.sum()) / (2 * 8 * 128) == sum(used))
"""


def test_read_pages_in_tritons_interpreter() -> None:
    """The read kernel on the CPU, in Triton's interpreter (where Triton is installed, as in
    the engines' environments; a process of its own, since Triton reads the switch once):
    two planes, one plane, and vLLM's cache whose pages hold K and V in one span. Each
    reads pages 3, 4, 9 and 5 once: the sums over a page's elements are 21 per element. Then
    SGLang's one-token pages, loaded one, two and the default number (four) at a time by each
    program: each distinct page once."""
    pytest.importorskip("triton")
    assert _interpreted(INTERPRETED) == ["21.0", "21.0", "21.0", "True", "True", "True"]


def _interpreted(code: str) -> list[str]:
    """What ``code`` prints, run in a fresh interpreter with Triton's interpreter switched on
    (Triton reads the switch once per process) and this repository on the path."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    path = os.pathsep.join([str(root / "python"), str(root), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=600, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.split()


VLLM_FORWARD = """
import types
import torch
from tools import kv_floor
from tools.vllm import noattn

calls = []
find = kv_floor.first_reads
kv_floor.first_reads = lambda *a: calls.append(1) or find(*a)

impl = object.__new__(noattn.KvFloorImpl)  # the constructor allocates on a GPU
impl.sink = torch.zeros(8)
pages, heads, bs, dims = 12, 2, 4, 8
# FLASH_ATTN's cache [pages, kv heads, block_size, 2 x dims], page p's K and V all p.
phys = torch.arange(pages, dtype=torch.float32)[:, None, None, None].expand(
    pages, bs, heads, 2 * dims).contiguous()
cache = phys.transpose(1, 2)
meta = types.SimpleNamespace(block_table=torch.tensor([[3, 4, 0], [3, 7, 9]], dtype=torch.int32),
                             seq_lens=torch.tensor([8, 9]))
out = torch.ones(3, 4)
for step in range(2):
    for index in range(3):  # three layers a step, the same metadata object both steps
        layer = types.SimpleNamespace(layer_name=f"model.layers.{index}.self_attn.attn")
        impl.forward(layer, out, out, out, cache, meta, output=out)
print(float(impl.sink.sum()) / (bs * heads * 2 * dims), int(out.abs().sum()), len(calls))
"""


def test_vllm_kv_floor_forward_reads_each_page_once_per_layer() -> None:
    """KVFLOOR's forward on vLLM's cache layout, in Triton's interpreter (a process of its own):
    rows [3, 4] and [3, 7, 9] read pages 3, 4, 7 and 9 once per layer, in each of three
    layers of two steps that reuse one metadata object (a new step starts at layer 0)."""
    pytest.importorskip("vllm")
    pytest.importorskip("triton")
    # Pages found once a step (its first layer), read by every layer; the output zeros.
    assert _interpreted(VLLM_FORWARD)[-3:] == [str(float((3 + 4 + 7 + 9) * 3 * 2)), "0", "2"]


def test_step_pages_are_found_at_each_steps_first_layer() -> None:
    """Once per step: at its first layer, whether the engine hands over a new step object
    (vLLM's metadata) or the same one again (SGLang's batch in a graph's warm-up and
    capture), and again for another object mid-way."""
    found: list[int] = []

    def find() -> tuple[torch.Tensor, torch.Tensor]:
        found.append(1)
        return torch.zeros(1), torch.tensor([len(found)])

    pages = kv_floor.StepPages()
    batch = object()
    counts = [int(pages.get(batch, layer, find)[1]) for layer in (0, 1, 2, 0, 1, 2)]
    assert counts == [1, 1, 1, 2, 2, 2]
    assert int(pages.get(object(), 3, find)[1]) == 3 and len(found) == 3
