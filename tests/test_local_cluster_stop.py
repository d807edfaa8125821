"""`cluster/local_cluster.py` stops its processes in Ray's own order: the GCS last. Real
processes stand in for a GCS (an executable named `gcs_server`, as Ray's is) and a raylet (a
Python process that, when told to stop, looks whether the GCS is still up, as a raylet reports
to it on its way out)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from loopback_cluster import cluster_script

RAYLET = textwrap.dedent(
    """
    import signal, sys, time
    from pathlib import Path

    gcs, out = int(sys.argv[1]), Path(sys.argv[2])

    def stopping(signum, frame):
        time.sleep(0.3)
        try:
            state = Path(f"/proc/{gcs}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            state = "gone"
        out.write_text("up" if state not in ("Z", "X", "gone") else "down")
        sys.exit(0)

    signal.signal(signal.SIGTERM, stopping)
    out.with_suffix(".ready").write_text("")
    while True:
        time.sleep(0.1)
    """
)


def _name(pid: int) -> str:
    return Path(f"/proc/{pid}/comm").read_text().strip()


def _wait_for(condition, what: str, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"waited {seconds:g} s for {what}"
        time.sleep(0.05)


def test_the_gcs_is_stopped_after_every_other_process_of_the_cluster(tmp_path):
    local_cluster = cluster_script("local_cluster")
    marker = os.urandom(8).hex()
    env = {**os.environ, local_cluster.MARKER_VAR: marker}
    gcs_binary = tmp_path / local_cluster.GCS_NAME
    shutil.copy(shutil.which("sleep"), gcs_binary)
    gcs = subprocess.Popen([str(gcs_binary), "600"], env=env, start_new_session=True)
    seen = tmp_path / "raylet.out"
    raylet = subprocess.Popen(
        [sys.executable, "-c", RAYLET, str(gcs.pid), str(seen)], env=env, start_new_session=True
    )
    try:
        _wait_for(lambda: seen.with_suffix(".ready").exists(), "the stand-in raylet to start")
        _wait_for(lambda: _name(gcs.pid) == "gcs_server", "the stand-in GCS to start")
        assert set(local_cluster._processes_marked(marker)) == {gcs.pid, raylet.pid}
        left = local_cluster.stop_marked(marker, grace=10)
        assert left == []
        assert seen.read_text() == "up", "the GCS was stopped before the raylet had stopped"
        assert raylet.wait(timeout=5) == 0
    finally:
        for proc in (gcs, raylet):
            if proc.poll() is None:
                proc.kill()
            proc.wait()


@pytest.mark.parametrize("name", ["gcs_server", "raylet"])
def test_only_a_process_named_gcs_server_counts_as_the_gcs(tmp_path, name):
    local_cluster = cluster_script("local_cluster")
    binary = tmp_path / name
    shutil.copy(shutil.which("sleep"), binary)
    proc = subprocess.Popen([str(binary), "600"], start_new_session=True)
    try:
        _wait_for(lambda: _name(proc.pid) == name, f"{name} to start")
        assert local_cluster._is_gcs(proc.pid) == (name == "gcs_server")
    finally:
        proc.kill()
        proc.wait()
