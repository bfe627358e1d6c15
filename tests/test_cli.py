"""The ``prefixattn`` command line."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from prefixattn.cli import main


def test_demo_runs_and_checks(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--tree", "1,3,9_64,32,7", "--heads", "8/2", "--page-size", "16"]) == 0
    text = capsys.readouterr().out
    assert "prefix forest" in text and "3 x node" in text
    assert "per_query" in text and "-> OK" in text


def test_default_demo(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    text = capsys.readouterr().out
    assert "tree 1,4,64_1024,256,128" in text and "-> OK" in text


def test_plan_bench(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan-bench", "--tree", "1,8_256,16", "--repeat", "3"]) == 0
    assert main(["plan-bench", "--tree", "1,8_256,16", "--repeat", "3", "--no-narrow"]) == 0
    assert "plan median" in capsys.readouterr().out


def test_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["frobnicate"]) == 2
    with pytest.raises(SystemExit):
        main(["demo", "--heads", "32"])
    with pytest.raises(ValueError, match="bad tree"):
        main(["demo", "--tree", "1,2"])


def test_console_script_is_installed() -> None:
    exe = shutil.which("prefixattn")
    if exe is None:
        pytest.skip("package not installed (running from a source tree)")
    done = subprocess.run(
        [exe, "demo", "--tree", "1,2_16,3", "--heads", "4/4", "--page-size", "4"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "-> OK" in done.stdout


def test_module_entry() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "prefixattn.cli", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0 and "demo" in done.stdout
