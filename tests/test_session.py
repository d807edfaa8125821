"""A local Ray instance: what its calls return inline, and its shutdown, where the autoscaler
monitor, which a local instance does not use, is killed first instead of being left to time out
against a stopped GCS."""

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


def printed(script: str) -> list[str]:
    """The lines `script` printed, run in a fresh Python with this checkout on its path; it
    must exit 0."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.splitlines()


@pytest.mark.slow
def test_a_local_session_kills_only_the_autoscaler_monitor_and_still_runs_and_stops():
    assert printed(SCRIPT) == [
        "monitor running True",
        "monitor killed True",
        "others running True",
        "worker ran",
        "ray stopped True",
    ]


INLINE = """
import time

import numpy as np
import ray
from silo_pfl.config import RayConfig
from silo_pfl.models import build_model
from silo_pfl.runtime import session

LOCATION_WAIT_S = 3.0

@ray.remote
class Worker:
    def answer(self, silos, state):
        return [{k: v.copy() for k, v in state.items()} for _ in range(silos)]

# Where the object is. A stored object's node reaches its owner a moment after the get, so this
# asks until one is named, or for LOCATION_WAIT_S (an object returned inline never has one).
def located(ref):
    deadline = time.monotonic() + LOCATION_WAIT_S
    while True:
        where = ray.experimental.get_object_locations([ref])[ref]
        if where["node_ids"] or time.monotonic() > deadline:
            return where
        time.sleep(0.05)

state = {k: v.numpy() for k, v in build_model("cnn_small", (1, 8, 8), 10).state_dict().items()}
with session.ray_session(RayConfig(num_cpus=1)):
    worker = Worker.remote()
    for silos in (5, 50):
        ref = worker.answer.remote(silos, state)
        got = ray.get(ref)
        assert all(np.array_equal(g[k], state[k]) for g in got for k in state)
        where = located(ref)
        size, stored = where["object_size"], bool(where["node_ids"])
        print(silos, "silos", "over 100 KiB" if size > 100 * 1024 else "small",
              "over the limit" if size > session.INLINE_BYTES else "under the limit",
              "in the object store" if stored else "inline")
"""


@pytest.mark.slow
def test_a_packed_workers_answers_for_a_small_model_come_back_inline_and_large_ones_stored():
    """Five silos' states of cnn_small, one worker's answer, pass Ray's default of 100 KiB
    but come back in the call's reply; fifty pass the local instance's limit and are stored."""
    assert printed(INLINE) == [
        "5 silos over 100 KiB under the limit inline",
        "50 silos over 100 KiB over the limit in the object store",
    ]
