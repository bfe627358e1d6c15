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


def test_plan_bench_chunk(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan-bench", "--chunk", "256,65536", "--page-sizes", "1,16", "--repeat", "2"]
    assert main([*argv, "--impl", "python"]) == 0
    out = capsys.readouterr().out
    # The 8 row chunks share the context's page ids: stored once per page size.
    assert "8 items, 65536 page ids" in out and "8 items, 4096 page ids" in out


def test_plan_bench_decode_run(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan-bench", "--decode-run", "16,256,8", "--page-sizes", "1,16", "--repeat", "20"]
    assert main([*argv, "--device", "cpu", "--profile", "3"]) == 0
    out = capsys.readouterr().out
    # The first step copies the table; the rest plan from the device table with the hint.
    assert out.count("copy:   1 steps") == 2 and out.count("hinted:  19 steps") == 2
    assert "cumulative" in out  # the profile
    # A request leaves every 4 steps: those steps are reported apart.
    assert main([*argv, "--device", "cpu", "--finish-every", "4"]) == 0
    out = capsys.readouterr().out
    assert out.count("hinted (batch changed):   4 steps") == 2
    assert out.count("one request leaving every 4 steps") == 2
    with pytest.raises(SystemExit):
        main([*argv, "--finish-every", "0"])
    with pytest.raises(SystemExit):
        main(["plan-bench", "--decode-run", "16,256"])
    with pytest.raises(SystemExit):
        main(["plan-bench", "--decode-run", "0,256,8"])


def test_heads_take_both_forms(capsys: pytest.CaptureFixture[str]) -> None:
    for heads in ("8/2", "8,2"):
        assert main(["demo", "--tree", "1,2_16,3", "--heads", heads, "--page-size", "4"]) == 0
        assert "heads 8/2" in capsys.readouterr().out
    assert main(["plan-bench", "--tree", "1,8_256,16", "--repeat", "1", "--heads", "8,2"]) == 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["demo", "--tree", "1,2"], "argument --tree: bad tree '1,2'"),
        (["demo", "--tree", "2,3_16,8"], "is not uniform"),
        (["demo", "--head-dim", "96"], "argument --head-dim: invalid choice: 96"),
        (["demo", "--heads", "32"], "argument --heads: wants QO/KV heads"),
        (["demo", "--heads", "32/5"], "QO a multiple of KV"),
        (["demo", "--heads", "64/2"], "group size at most 16"),
        (["demo", "--page-size", "0"], "argument --page-size: wants a positive integer"),
        (["demo", "--page-size", "256"], "larger than 128"),
        (["demo", "--dtype", "int8"], "argument --dtype"),
        (["demo", "--device", "tpu"], "--device"),
        (["plan-bench", "--tree", "x"], "argument --tree: bad tree"),
        (["plan-bench", "--page-sizes", "16,x"], "argument --page-sizes"),
        (["plan-bench", "--repeat", "0"], "argument --repeat"),
        (["plan-bench", "--heads", "8"], "argument --heads"),
        (["plan-bench", "--chunk", "16"], "argument --chunk: expected TOKENS,CONTEXT"),
        (["plan-bench", "--chunk", "32,16"], "need 0 < TOKENS <= CONTEXT"),
        (["bench", "--heads", "32:8"], "argument --heads"),
        (["bench", "--head-dim", "96"], "argument --head-dim"),
    ],
)
def test_bad_arguments_give_one_line_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"prefixattn {argv[0]}: error: ") and message in last, err


def test_unknown_command() -> None:
    assert main(["frobnicate"]) == 2


def test_bad_argument_from_the_console_has_no_traceback() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "prefixattn.cli", "demo", "--head-dim", "96"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and "error: argument --head-dim" in done.stderr


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
