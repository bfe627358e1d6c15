"""The library built on first use: cache keys, the build command, the kernels' status, and the
refusal of CUDA tensors without kernels (the compile itself runs in every session that plans
with the native planner)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from prefixattn import attention
from prefixattn.cli import main
from prefixattn.runtime import compile as build
from prefixattn.runtime import info, library


def test_cache_dir_follows_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path))
    spec = build.BuildSpec(("90a",))
    path = build.build_dir(spec)
    assert path.parent == tmp_path
    assert torch.__version__ in path.name and "sm90a" in path.name
    assert build.build_dir(build.BuildSpec()).name != path.name  # CPU-only is its own build


def test_sources_hash_changes_with_any_source(tmp_path: Path) -> None:
    root = build.source_dir()
    copy = tmp_path / "src"
    for part in ("CMakeLists.txt", "cmake", "cpp"):
        src = root / part
        if src.is_dir():
            shutil.copytree(src, copy / part)
        else:
            copy.mkdir(exist_ok=True)
            shutil.copy(src, copy / part)
    before = build.sources_hash(copy)
    assert before == build.sources_hash(root)
    header = next((copy / "cpp").rglob("*.h"))
    header.write_text(header.read_text() + "\n// changed\n")
    assert build.sources_hash(copy) != before


def test_cached_build_is_reused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path))
    spec = build.BuildSpec()
    out = build.build_dir(spec)
    out.mkdir(parents=True)
    (out / "build-info.json").write_text(json.dumps({"compile_seconds": 1.0}))

    def no_compile(*args: object) -> None:
        raise AssertionError("a cached build must not be compiled again")

    monkeypatch.setattr(build, "_compile", no_compile)
    assert build.ensure_built(spec) == out / "_C.so"


def test_failed_build_names_its_log(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(build, "source_dir", lambda: tmp_path / "missing")
    with pytest.raises(build.BuildError, match=r"build\.log"):
        build._compile(build.BuildSpec(), tmp_path / "out", verbose=False)


def test_default_spec_without_gpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert build.default_spec() == build.BuildSpec()
    assert build.device_problem() is not None
    assert library.kernels_status().startswith("not available: ")


def test_build_command_rejects_unsupported_arch(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["build", "--cuda-archs", "80"])
    assert e.value.code == 2
    assert "--cuda-archs 80: not supported" in capsys.readouterr().err


def test_info_reports_environment(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["torch"] == torch.__version__
    assert set(report["engines"]) == {"vllm", "sglang"}
    assert report["library"]["wanted"] == build.default_spec().tag
    text = info.render(report)
    assert "CUDA kernels" in text and "library" in text


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_tensors_without_kernels_are_refused(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    monkeypatch.setattr(library, "kernels_status", lambda: "not available: no CUDA device")
    with pytest.raises(RuntimeError, match="use_kernels = False") as e:
        attention._require_kernels(dtype)
    if dtype == torch.float32:
        assert "float16 or bfloat16" in str(e.value)
    else:
        assert "no CUDA device" in str(e.value)
