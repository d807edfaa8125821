"""Deadlines of the per-silo steps outside the fits: a worker holding k silos (packed), which
runs their calls one after another, is waited for k times round.call_timeout_s; and the steps of
an onboarding's round, bounded by round.timeout_s, say so when late. The runs load
tests/fault_plugins.py's slow_rounds: FedPer whose silos' model builds and local procedures
sleep a known time."""

from __future__ import annotations

import numpy as np
import pytest

from silo_pfl.config import to_dict
from silo_pfl.errors import FederationError
from silo_pfl.federation import Federation
from silo_pfl.onboarding import joining_config
from silo_pfl.runtime.onboarding import Onboarding
from silo_pfl.server_start import new_server
from silo_pfl.tracking.trained_run import TrainedRun

PLUGIN = "plugins=[tests.fault_plugins]"


def test_a_packed_worker_gets_round_call_timeout_s_for_each_of_its_silos_set_up(job, ray_local):
    """Two silos building for 1.2 s each in one worker answer after 2.4 s: each is held to
    round.call_timeout_s=2, as in a process of its own, so the run goes on. A first run warms the
    session's workers (runtime.host_pool): the second's set-up imports no torch in its 2 s."""
    quick = ("rounds=1", "ray.silos_per_worker=2", "tracking.enabled=false", "train.local_epochs=1")
    Federation(job("jobs/heart_disease.yaml", *quick)).run()
    cfg = job(
        "jobs/heart_disease.yaml",
        *quick,
        PLUGIN,
        "algorithm.name=slow_rounds",
        "algorithm.slow_rounds.seconds=0",
        "algorithm.slow_rounds.build_s=1.2",
        "round.call_timeout_s=2",
    )
    result = Federation(cfg).run()
    everyone = ["cleveland", "hungarian", "switzerland", "va"]
    assert [s.participants for s in result.history] == [everyone]


def test_a_late_onboarding_round_names_round_timeout_s(job, ray_local):
    """The joining silo's training outlasts round.timeout_s=1: the error names that setting,
    not round.call_timeout_s, which bounds the set-up."""
    common = (PLUGIN, "algorithm.name=slow_rounds", "algorithm.slow_rounds.seconds=0")
    common += ("algorithm.slow_rounds.phases_s=3",)
    common += ("data.late_silos=[va]",)
    cfg = job("jobs/heart_disease.yaml", *common, "tracking.enabled=false")
    server = new_server(to_dict(cfg), (13,), 2)
    state = {k: np.array(v) for k, v in server.global_state().items()}
    founders = {"silos": {"cleveland": {"test_accuracy": 0.8}}}
    trained = TrainedRun("run-1", to_dict(cfg), (13,), 2, state, founders)
    mine = job(
        "jobs/heart_disease.yaml",
        *common,
        "rounds=1",
        "round.timeout_s=1",
        "tracking.enabled=false",
    )
    joined = joining_config(trained, mine, "va")
    with pytest.raises(FederationError) as late:
        Onboarding(joined, trained, "va").run()
    message = str(late.value)
    assert "round 1: silo training: no answer within round.timeout_s=1 s from silo va" in message
    assert "call_timeout_s" not in message
