"""A local Ray instance's shutdown: the autoscaler monitor, which a local instance does not use,
is killed first instead of being left to time out against a stopped GCS."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import signal
import ray
from silo_pfl.config import RayConfig
from silo_pfl.runtime import session

with session.ray_session(RayConfig(num_cpus=1)):
    node = ray._private.worker._global_node
    (monitor,) = [info.process for info in node.all_processes["monitor"]]
    others = [i.process for kind, infos in node.all_processes.items() if kind != "monitor"
              for i in infos]
    print("monitor running", monitor.poll() is None)
    session.stop_autoscaler_monitor()
    print("monitor killed", monitor.returncode == -signal.SIGKILL)
    print("others running", bool(others) and all(p.poll() is None for p in others))
    print("worker", ray.get(ray.remote(lambda: "ran").remote()))
print("ray stopped", not ray.is_initialized() and all(p.poll() is not None for p in others))
"""


@pytest.mark.slow
def test_a_local_session_kills_only_the_autoscaler_monitor_and_still_runs_and_stops():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == [
        "monitor running True",
        "monitor killed True",
        "others running True",
        "worker ran",
        "ray stopped True",
    ]
