"""The server refuses, with a named reason, any update it must not aggregate."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from silo_pfl.config import to_dict
from silo_pfl.messages import SiloUpdate
from silo_pfl.server import Server
from silo_pfl.silo import Silo


@pytest.fixture
def round_one(job):
    """A server for the four hospitals and hungarian's real update for round 1."""
    config = to_dict(job("jobs/heart_disease.yaml"))
    silo = Silo(config, "hungarian")
    info = silo.setup()
    silo.build(info.input_shape, info.num_classes)
    server = Server(config, info.input_shape, info.num_classes)
    update, _ = silo.fit(server.global_state(), 1)
    return server, update


def _nan(update: SiloUpdate) -> SiloUpdate:
    key = next(iter(update.delta))
    bad = update.delta[key].copy()
    bad.flat[0] = np.nan
    return dataclasses.replace(update, delta={**update.delta, key: bad})


def _float64(update: SiloUpdate) -> SiloUpdate:
    return dataclasses.replace(
        update, delta={k: v.astype(np.float64) for k, v in update.delta.items()}
    )


@pytest.mark.parametrize(
    ("forge", "reason"),
    [
        (lambda u: [u, u], "update from silo hungarian: a second update this round"),
        (
            lambda u: [dataclasses.replace(u, round=2)],
            "update from silo hungarian: for round 2, but round 1 is being aggregated",
        ),
        (
            lambda u: [dataclasses.replace(u, silo="mallory")],
            "update from silo mallory: not a silo of this federation (its silos are cleveland,",
        ),
        (lambda u: [_nan(u)], "update from silo hungarian: body.fc1.weight is not finite"),
        (lambda u: [_float64(u)], "is float64, expected float32"),
    ],
)
def test_a_bad_update_is_refused_with_its_reason_and_changes_nothing(round_one, forge, reason):
    server, update = round_one
    before = {k: v.copy() for k, v in server.global_state().items()}
    with pytest.raises(ValueError) as info:
        server.aggregate(*forge(update))
    assert reason in str(info.value)
    assert server.round == 0
    assert all(np.array_equal(before[k], v) for k, v in server.global_state().items())
    server.aggregate(update)  # the genuine update of round 1 still goes through
    assert server.round == 1
    with pytest.raises(ValueError, match="for round 1, but round 2 is being aggregated"):
        server.aggregate(update)  # and cannot be replayed in round 2
