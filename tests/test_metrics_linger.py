"""A local run with live metrics on, at its edges: the service-discovery file it cannot write is
one line naming it, and Ctrl-C while the run only lingers for a scrape ends it as a finished run,
its results written."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
JOB = "jobs/heart_disease.yaml"


@pytest.fixture
def ray_tmp() -> Iterator[Path]:
    """A Ray temp directory of the test's own (where the discovery file goes), short: Ray's
    socket paths under it must fit in 107 bytes."""
    path = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _env(ray_tmp: Path) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    return {**base, "RAY_TMPDIR": str(ray_tmp)}


def test_a_discovery_file_that_cannot_be_written_is_one_line(tmp_path, ray_tmp):
    blocked = ray_tmp / "ray" / "prom_metrics_service_discovery.json"
    blocked.mkdir(parents=True)  # a directory where the file's link goes
    command = [sys.executable, "-m", "silo_pfl", "run", JOB, "rounds=1", "metrics.enabled=true"]
    command += ["tracking.enabled=false", f"output_dir={tmp_path / 'runs'}"]
    done = subprocess.run(
        command, cwd=ROOT, env=_env(ray_tmp), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 2, done.stderr[-2000:]
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(
        f"error: metrics.enabled: cannot write Prometheus' service-discovery file {blocked} "
    ), line
    assert not (tmp_path / "runs").exists()


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_while_lingering_for_a_scrape_ends_the_run_as_finished(tmp_path, ray_tmp):
    results = tmp_path / "results.json"
    command = [sys.executable, "-m", "silo_pfl", "run", JOB, "rounds=2", "metrics.enabled=true"]
    command += ["metrics.linger_s=600", "tracking.enabled=false", f"output_dir={tmp_path / 'r'}"]
    command += ["--results", str(results)]
    proc = subprocess.Popen(
        command,
        cwd=ROOT,
        env=_env(ray_tmp),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        # A background job of a non-interactive shell (CI's) inherits SIGINT ignored, and a
        # Python started so never raises KeyboardInterrupt: the run gets a terminal's default.
        preexec_fn=_default_sigint,
    )
    lines = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("metrics: waiting up to "):
                break  # the run's end is done; it waits for a scrape that never comes
        assert proc.poll() is None, "".join(lines)
        os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the whole group
        rest, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    printed = "".join(lines) + rest
    assert proc.returncode == 0, printed[-3000:]
    assert "interrupted" not in printed and "Traceback" not in printed
    assert results.is_file()
