"""Backend variants of the benchmarks (``tools/variants.py``) and the SGLang plugin that sets
core options in an engine's processes (``tools/sglang/core_options.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools.serving import bench
from tools.sglang.core_options import plugin_env
from tools.variants import parse_variant

ROOT = Path(__file__).resolve().parents[2]


def test_parse_variant() -> None:
    assert parse_variant("FLASH_ATTN") == ("FLASH_ATTN", {})
    assert parse_variant("prefixattn+split_waves") == (
        "prefixattn",
        {"core_options": {"split_waves": True}},
    )
    assert parse_variant("CUSTOM+split_target=66+chain_launches=false", ours="CUSTOM") == (
        "CUSTOM",
        {"core_options": {"split_target": 66, "chain_launches": False}},
    )
    # StepOptions fields are step options, the rest core options.
    assert parse_variant("prefixattn+count_fallbacks+split_waves=false") == (
        "prefixattn",
        {"count_fallbacks": True, "core_options": {"split_waves": False}},
    )
    assert parse_variant("prefixattn+hinted_plans=false") == (
        "prefixattn",
        {"hinted_plans": False},
    )


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("+split_waves", "no backend before"),
        ("prefixattn+", "an empty option"),
        ("prefixattn+split_target=six", "is not JSON"),
        ("prefixattn+no_such=1", "'no_such' is no PlanOptions or LaunchOptions field"),
        ("prefixattn+split_waves=3", "split_waves"),
        ("prefixattn+count_fallbacks=2", "count_fallbacks must be"),
        ("triton+split_waves", "apply to prefixattn only"),
    ],
)
def test_bad_variants(name: str, message: str) -> None:
    with pytest.raises((ValueError, TypeError, AttributeError), match=message):
        parse_variant(name, ours="prefixattn")


def test_serving_bench_takes_variants(capsys) -> None:
    args = bench.parse_args(["--engine", "sglang", "--backends", "prefixattn+split_waves", "bound"])
    assert args.backends == ["bound", "prefixattn+split_waves"]
    with pytest.raises(SystemExit):
        bench.parse_args(["--engine", "vllm", "--backends", "FLASH_ATTN+split_waves"])
    assert "apply to prefixattn only" in capsys.readouterr().err


def test_sglang_plugin_sets_core_options(tmp_path) -> None:
    # The plugin's entry point, loaded the way SGLang's load_plugins() loads it, sets the
    # process defaults every StepPlanner (and so every core) of that process starts from.
    changes = {"count_fallbacks": True, "core_options": {"split_waves": True, "split_target": 66}}
    env = plugin_env(tmp_path / "plugin", changes)
    assert env["PYTHONPATH"].split(os.pathsep)[:2] == [str(tmp_path / "plugin"), str(ROOT)]
    code = (
        "import importlib.metadata as md\n"
        "from prefixattn.engine.step import default_options\n"
        "for ep in md.entry_points(group='sglang.srt.plugins'):\n"
        "    if ep.name == 'prefixattn_bench_core_options':\n"
        "        ep.load()()\n"
        "o = default_options()\n"
        "print(o.count_fallbacks, dict(o.core_options))\n"
    )
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(ROOT / "python")])
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True {'split_waves': True, 'split_target': 66}"
    # The serving benchmark's SGLang worker gets it; vLLM takes additional_config instead.
    sgl = bench.parse_args(["--engine", "sglang", "--backends", "prefixattn+split_waves"])
    got = bench.worker_env(sgl, "prefixattn+split_waves", tmp_path)
    assert str(tmp_path / "core-options") in got["PYTHONPATH"]
