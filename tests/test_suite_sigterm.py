"""The suite itself under SIGTERM (a CI's timeout, `kill`): it stops, and the fixtures' teardowns
run, so the clusters and servers they started do not outlive it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

INNER = """
import time
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def held():
    yield
    Path({mark!r}).write_text("torn down")


def test_waits(held):
    print("ready", flush=True)
    time.sleep(120)
"""


def test_sigterm_stops_the_session_and_runs_its_teardowns(tmp_path):
    mark = tmp_path / "teardown"
    inner = tmp_path / "test_inner.py"
    inner.write_text(INNER.format(mark=str(mark)))
    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    command = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "conftest"]
    command += ["-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(inner)]
    proc = subprocess.Popen(
        command,
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if "ready" in line:
                break
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 2, out  # pytest's "interrupted"
    assert mark.read_text() == "torn down", out
