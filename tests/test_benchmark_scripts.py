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


def test_the_relay_is_measured_between_a_rounds_last_fit_and_first_evaluation(
    tmp_path: Path,
) -> None:
    """relay.py's silos note their fits' ends and evaluations' starts in their own processes
    (its plugin reaches Ray's workers), and no evaluation of a round begins before the round's
    last fit has ended: the server's sum lies between them."""
    done = run_script("relay.py", tmp_path, "--rounds", "6", "--repeats", "1")
    assert done.returncode == 0, done.stderr[-2000:]
    row = re.search(r"^\| 1 \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$", done.stdout, re.M)
    assert row, done.stdout
    median, q1, q3, round_ms = map(float, row.groups())
    assert 0 < q1 <= median <= q3 < round_ms


def test_a_misspelt_algorithm_is_one_line_before_ray_starts(tmp_path: Path) -> None:
    """The results scripts follow the CLI: a bad setting is one line, exit 2, no traceback; every
    config is checked before the first run, so the last one's typo costs no earlier run."""
    done = run_script(
        "accuracy.py",
        tmp_path,
        str(ROOT / "jobs/heart_disease.yaml"),
        "--algorithms",
        "fedper",
        "nosuch",
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stdout == ""
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("error: algorithm.name: got 'nosuch', expected one of "), line


def test_a_baseline_that_is_not_run_is_refused_before_any_run(tmp_path: Path) -> None:
    """accuracy.py ran every algorithm, then lost them all to a KeyError: 'local'."""
    job = str(ROOT / "jobs/heart_disease.yaml")
    runs = ("--algorithms", "fedper", "local@lr:train.lr=0.01")
    done = run_script("accuracy.py", tmp_path, job, *runs, "--baseline", "local")
    assert done.returncode == 2 and done.stdout == "", done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1] == (
        "accuracy.py: error: --baseline local: expected one of --algorithms (fedper, local@lr)"
    )
