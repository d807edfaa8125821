"""The CLI's progress over rounds: a tqdm bar under a pseudo-terminal, plain lines in a pipe.
The drivers join the session's local Ray, as a Ray Job's driver joins its cluster: what is
printed does not depend on who started Ray."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys

import pytest
from drivers import joining_env

RUN = ["run", "jobs/heart_disease.yaml", "rounds=3", "tracking.enabled=false"]
LINE = re.compile(
    r"^round (\d)/3 +\d+\.\d+s  elapsed \d+:\d\d  eta \d+:\d\d  loss \d\.\d{4}  "
    r"val (\d\.\d{3}|-)  slowest (cleveland|hungarian|switzerland|va) \d+\.\d\ds$"
)


def _argv(tmp_path, *more: str) -> list[str]:
    return [sys.executable, "-m", "silo_pfl", *RUN, *more, f"output_dir={tmp_path / 'runs'}"]


def test_a_pipe_gets_one_plain_line_per_round(ray_local, tmp_path):
    """Round 1 is not evaluated (eval.every=2): its line has no validation accuracy."""
    done = subprocess.run(
        _argv(tmp_path, "eval.every=2"),
        capture_output=True,
        text=True,
        timeout=300,
        env=joining_env(),
    )
    assert done.returncode == 0, done.stderr
    assert "\r" not in done.stdout and "\x1b[" not in done.stdout
    rounds = [m for m in map(LINE.match, done.stdout.splitlines()) if m]
    assert [int(m.group(1)) for m in rounds] == [1, 2, 3], done.stdout
    assert rounds[0].group(2) == "-"
    assert all(0.0 <= float(m.group(2)) <= 1.0 for m in rounds[1:])
    assert "mean test accuracy" in done.stdout


@pytest.mark.skipif(shutil.which("script") is None, reason="needs script(1) from util-linux")
def test_a_terminal_gets_a_bar_with_eta_val_and_the_slowest_silo(ray_local, tmp_path):
    command = shlex.join(_argv(tmp_path))
    done = subprocess.run(
        ["script", "-qec", command, "/dev/null"],
        capture_output=True,
        timeout=300,
        env={**joining_env(), "COLUMNS": "120", "TERM": "xterm"},
        stdin=subprocess.DEVNULL,
    )
    screen = done.stdout.decode()  # bytes: universal newlines would turn each redraw's \r to \n
    assert done.returncode == 0, screen + done.stderr.decode()
    assert not [line for line in screen.splitlines() if LINE.match(line.strip())]
    redraws = screen.split("\r")
    final = [r for r in redraws if r.startswith("round 3/3 |")]
    assert final, screen
    bar = final[-1]
    assert re.search(r"\| \d\d:\d\d<00:00, val \d\.\d{3}  slowest \w+ \d+\.\d\ds", bar), bar
    assert "█" in bar
    assert "mean test accuracy" in screen
