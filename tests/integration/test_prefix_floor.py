"""The prefix-math floor of the decode benchmarks (``tools/prefix_floor.py``): its checks, its
K/V, its registration in both engines, and the benchmarks' refusal of workloads it does not
model. Its FA3 call needs a GPU and the engines: it runs in the GPU benchmarks."""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path

import pytest
from conftest import sglang_plugin_registers

from tools import prefix_floor
from tools.sglang import bench_decode as sgl_bench
from tools.vllm import bench_decode as vllm_bench

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("tokens", "message"),
    [(0, "not in 1"), (1 << 21, "not in 1"), (True, "must be an int"), (4096.0, "must be an int")],
)
def test_bad_floor_tokens(tokens, message) -> None:
    with pytest.raises(ValueError, match=message):
        prefix_floor.check_floor_tokens(tokens)


def test_random_kv_per_layer() -> None:
    torch = pytest.importorskip("torch")
    kv = prefix_floor.random_kv(3, 40, 2, 8, torch.float32, "cpu")
    assert len(kv) == 3 and all(len(p) == 2 for p in kv)
    assert all(t.shape == (1, 40, 2, 8) and t.dtype == torch.float32 for p in kv for t in p)
    assert not torch.equal(kv[0][0], kv[1][0])  # each layer reads its own K/V
    assert torch.equal(kv[2][1], prefix_floor.random_kv(3, 40, 2, 8, torch.float32, "cpu")[2][1])


def test_sglang_floor_takes_one_shared_prefix(monkeypatch, capsys) -> None:
    assert sgl_bench.floor_tokens(["shared1:4096"]) == 4096
    for workloads in (["shared1:4096", "none:1024"], ["shared3:4096"]):
        with pytest.raises(ValueError, match="one shared1:P workload"):
            sgl_bench.floor_tokens(workloads)
    argv = ["bench_decode", "--backends", "noattn", "prefixfloor", "--workloads", "none:1024"]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit):
        sgl_bench.main()
    assert "prefixfloor runs one shared1:P workload" in capsys.readouterr().err


def test_vllm_floor_takes_shared1_only(monkeypatch, capsys, tmp_path) -> None:
    argv = ["bench_decode", "--out", str(tmp_path / "o.json"), "--backends", "PREFIXFLOOR",
            "--workloads", "shared1", "none"]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit):
        vllm_bench.main()
    assert "PREFIXFLOOR runs --workloads shared1 only" in capsys.readouterr().err
    # With the floor in the run every engine core runs in its worker process, as the bound's.
    calls = []

    def fake_run(cmd, timeout):
        calls.append(cmd)
        return 1

    monkeypatch.setattr(vllm_bench, "write_model", lambda path, max_len: None)
    monkeypatch.setattr(vllm_bench, "run_in_group", fake_run)
    monkeypatch.setattr(sys, "argv", argv[:-1])
    assert vllm_bench.main() == 1
    assert calls and "--in-process" in calls[0]


def test_sglang_floor_plugin(tmp_path) -> None:
    pytest.importorskip("sglang")
    from tools.sglang.noattn import floor_plugin_env

    with pytest.raises(ValueError, match="not in 1"):
        floor_plugin_env(tmp_path / "bad", 0)
    env = floor_plugin_env(tmp_path / "plugin", 2048)
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(ROOT / "python")])
    got = sglang_plugin_registers(env, tmp_path, "prefixfloor", extra="noattn.FLOOR_TOKENS")
    assert got == "registered (True, True, 2048)"


def test_vllm_floor_backend() -> None:
    pytest.importorskip("vllm")
    torch = pytest.importorskip("torch")
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from tools.vllm import noattn

    noattn.register_floor(1024)
    noattn.register_floor(1024)
    assert noattn.FLOOR_TOKENS == 1024
    member = AttentionBackendEnum[noattn.FLOOR]
    assert member.get_class() is noattn.PrefixFloorBackend
    assert noattn.PrefixFloorBackend.get_impl_cls() is noattn.PrefixFloorImpl
    assert issubclass(noattn.PrefixFloorBackend, noattn.NoAttentionBackend)
    # Steps that are not decode-only are the bound's: zeros, no kernel.
    impl = object.__new__(noattn.PrefixFloorImpl)  # the constructor allocates on a GPU
    out = torch.ones(5, 4, 8)
    meta = types.SimpleNamespace(max_query_len=7)
    assert impl.forward(None, out, out, out, None, meta, output=out) is out
    assert not out.any()
