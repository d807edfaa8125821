"""Waiting on actors: bounded, and whoever did not answer is named."""

from __future__ import annotations

import time

import pytest

from silo_pfl.errors import FederationError
from silo_pfl.runtime.actors import get


def test_a_wait_past_its_bound_names_the_silos_that_did_not_answer(ray_local):
    @ray_local.remote(num_cpus=0)
    def answer(seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    refs = [answer.remote(0), answer.remote(30), answer.remote(0)]
    assert get(refs[:1], "silo set-up", 60, ["silo a"]) == [0]
    began = time.monotonic()
    with pytest.raises(FederationError) as info:
        get(refs, "silo set-up", 2, ["silo a", "silo b", "silo c"])
    assert time.monotonic() - began < 10
    assert str(info.value) == "silo set-up: no answer within round.call_timeout_s=2 s from silo b"
    with pytest.raises(FederationError) as info:
        get(refs[1:2], "round 1: aggregation", 0.5, key="round.timeout_s")
    assert str(info.value) == "round 1: aggregation: no answer within round.timeout_s=0.5 s"
    ray_local.cancel(refs[1], force=True)


def test_round_timeout_must_be_positive(job):
    from silo_pfl.errors import ConfigError

    with pytest.raises(ConfigError, match="round.timeout_s: got 0.0, expected a number of seconds"):
        job("jobs/heart_disease.yaml", "round.timeout_s=0")
