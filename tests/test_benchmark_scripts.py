"""The benchmark scripts run from any directory, as a user runs them: the jobs they default to are
the repository's, wherever the command is typed."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_script(script: str, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`python benchmarks/<script> args` run from `cwd`."""
    command = [sys.executable, str(ROOT / "benchmarks" / script), *args]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=300)


def test_a_scripts_own_job_is_found_from_another_directory(tmp_path: Path) -> None:
    done = run_script("bytes_per_round.py", tmp_path, "--out", str(tmp_path / "bytes.json"))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "not found" not in done.stdout, done.stdout  # a row whose job was not read
    assert re.search(r"^cnn_small +fedavg +0 +[\d,]+ +0\.00%$", done.stdout, re.MULTILINE)
    assert '"job": "jobs/digits_label_skew.yaml"' in (tmp_path / "bytes.json").read_text()


def test_the_default_job_of_a_scripts_parser_is_found_from_another_directory(
    tmp_path: Path,
) -> None:
    done = run_script("work_vs_limit.py", tmp_path, "--rounds", "5")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| **federation / limit** |" in done.stdout, done.stdout
