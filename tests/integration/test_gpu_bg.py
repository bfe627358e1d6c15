"""scripts/gpu_bg.sh: a background run, its step markers, waiting and the packed logs."""

from __future__ import annotations

import subprocess
import tarfile
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_bg.sh"


def bg(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "GPU_BG_ROOT": str(tmp_path / "bg"), "OUT": str(tmp_path)}
    return subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=60
    )


def test_run_steps_and_logs(tmp_path: Path) -> None:
    cmd = (
        "echo first; bash " + str(SCRIPT) + " mark r one; echo data > $BG_DIR/x.txt; "
        "sleep 2; echo second; exit 3"
    )
    started = bg(tmp_path, "start", "r", "bash", "-c", cmd)
    assert started.returncode == 0 and "started 'r'" in started.stdout
    # A second run of the same name is refused while the first goes on.
    again = bg(tmp_path, "start", "r", "true")
    assert again.returncode == 1 and "still going" in again.stderr
    one = bg(tmp_path, "wait", "r", "one", "30")
    assert one.returncode == 0 and "'one' reached" in one.stdout and "first" in one.stdout
    end = bg(tmp_path, "wait", "r", "30")
    assert end.returncode == 0 and "ended: exit 3" in end.stdout and "second" in end.stdout
    with tarfile.open(tmp_path / "r.tgz") as tar:
        names = set(tar.getnames())
    assert {"r/progress.log", "r/rc", "r/steps/one", "r/x.txt"} <= names
    missing = bg(tmp_path, "wait", "r", "never", "30")
    assert missing.returncode == 1 and "without step 'never'" in missing.stdout
    status = bg(tmp_path, "status", "r")
    assert "ended: exit 3" in status.stdout and "one" in status.stdout


def test_wait_times_out_while_running(tmp_path: Path) -> None:
    assert bg(tmp_path, "start", "s", "sleep", "20").returncode == 0
    t0 = time.monotonic()
    waited = bg(tmp_path, "wait", "s", "1")
    assert waited.returncode == 1 and "not reached after 1 s" in waited.stdout
    assert time.monotonic() - t0 < 15
    assert "running" in bg(tmp_path, "status", "s").stdout


def test_usage_and_unknown_runs(tmp_path: Path) -> None:
    usage = bg(tmp_path)
    assert usage.returncode == 2 and "gpu_bg.sh start NAME" in usage.stdout
    assert "set -uo" not in usage.stdout
    assert bg(tmp_path, "wait", "nope", "1").returncode == 1
    assert bg(tmp_path, "start", "x").returncode == 2
