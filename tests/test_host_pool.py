"""Workers kept warm between the runs of one Ray session (runtime.host_pool): the next run
opens its silos in the same processes, and computes exactly what fresh processes compute."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import ray

from silo_pfl.callbacks import Callback
from silo_pfl.federation import Federation
from silo_pfl.runtime import host_pool

pytestmark = pytest.mark.usefixtures("ray_local")

SMALL = (
    "tracking.enabled=false",
    "data.num_silos=4",
    "data.classes_per_silo=3",
    "rounds=2",
    "train.local_epochs=1",
    "seed=11",
)


class Pids(Callback):
    """The process of each silo, as it reported at set-up."""

    def __init__(self) -> None:
        self.pids: dict[str, int] = {}

    def on_start(self, config, silos, split) -> None:
        self.pids = {info.silo: info.pid for info in silos}


def _run(job, *overrides: str) -> tuple[dict, dict[str, int], dict[str, np.ndarray]]:
    pids = Pids()
    result = Federation(
        job("jobs/digits_label_skew.yaml", *SMALL, *overrides), callbacks=[pids]
    ).run()
    state = np.load(result.global_state_path)
    per_silo = {n: (s.test_accuracy, s.val_accuracy) for n, s in result.silos.items()}
    return per_silo, pids.pids, {k: state[k] for k in state.files}


def test_the_next_run_reuses_the_workers_and_computes_what_fresh_workers_compute(job):
    host_pool.drain()
    fresh, fresh_pids, fresh_state = _run(job)
    assert sum(len(idle) for idle in host_pool._idle.values()) == 3  # 2 silo workers, server
    other, _, _ = _run(job, "algorithm.name=fedper", "seed=5")  # another run in between
    again, again_pids, again_state = _run(job)
    assert set(again_pids.values()) == set(fresh_pids.values())  # the same two processes
    assert again == fresh
    assert fresh_state.keys() == again_state.keys()
    assert all(np.array_equal(fresh_state[k], again_state[k]) for k in fresh_state)
    assert other != fresh


def test_a_failed_run_keeps_none_of_its_workers(job):
    host_pool.drain()
    with pytest.raises(Exception, match="diverged|not finite|nan"):
        _run(job, "train.lr=1e12")
    assert not any(host_pool._idle.values())


def _pid(worker) -> int:
    """The process id of a Ray actor, asked of the actor itself."""
    return ray.get(worker.__ray_call__.remote(lambda self: os.getpid()), timeout=30)


def test_an_idle_worker_that_died_is_not_handed_to_the_next_run(job):
    host_pool.drain()
    _run(job, "rounds=1")
    (server,) = (w for k, idle in host_pool._idle.items() if "ServerHost" in k for w in idle)
    pid = _pid(server)
    os.kill(pid, signal.SIGKILL)  # the idle server dies (the OOM killer, say); Ray restarts none
    deadline = time.monotonic() + 30
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    per_silo, _, _ = _run(job, "rounds=1")  # a new server, not the dead one
    assert len(per_silo) == 4
