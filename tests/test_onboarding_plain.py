"""Cold start on the plain classes (no Ray, no MLflow): the joining config and `Silo.adapt`."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from silo_pfl.algorithms import ALGORITHMS
from silo_pfl.config import to_dict
from silo_pfl.errors import ConfigError
from silo_pfl.messages import SiloOutcome
from silo_pfl.onboarding import alone_config, joining_config, onboard_report
from silo_pfl.server_start import new_server
from silo_pfl.silo import Silo
from silo_pfl.tracking.trained_run import TrainedRun

JOB = "jobs/heart_disease.yaml"
SHAPE, CLASSES = (13,), 2


def _trained(job, *overrides: str) -> TrainedRun:
    """A 'trained' federation without the late hospital va: its initial global keys will do."""
    cfg = job(JOB, "data.late_silos=[va]", "tracking.enabled=false", *overrides)
    server = new_server(to_dict(cfg), SHAPE, CLASSES)
    founders = {"cleveland": {"test_accuracy": 0.8}, "hungarian": {"test_accuracy": 0.7}}
    state = {k: np.array(v) for k, v in server.global_state().items()}
    return TrainedRun("run-1", to_dict(cfg), SHAPE, CLASSES, state, {"silos": founders})


def _joining(job, trained: TrainedRun, *overrides: str) -> Silo:
    cfg = joining_config(trained, job(JOB, "tracking.enabled=false", *overrides), "va")
    silo = Silo(to_dict(cfg), "va")
    silo.setup()
    silo.build(trained.input_shape, trained.num_classes)
    return silo


def test_the_trained_run_decides_model_split_and_algorithm(job):
    trained = _trained(job, "algorithm.name=fedrep", "model.hidden=[16,8]", "split.local=[last:2]")
    mine = job(JOB, "tracking.enabled=false", "algorithm.name=fedavg", "rounds=3", "train.lr=0.1")
    cfg = joining_config(trained, mine, "va")
    assert cfg.algorithm["name"] == "fedrep" and list(cfg.model.hidden) == [16, 8]
    assert list(cfg.split.local) == ["last:2"]
    assert cfg.rounds == 3 and cfg.train.lr == 0.1
    alone = alone_config(cfg)
    assert alone.algorithm["name"] == "local" and alone.split.local is None
    assert alone.rounds == 3 and list(alone.model.hidden) == [16, 8]


@pytest.mark.parametrize(
    ("silo", "message"),
    [
        ("cleveland", "--silo cleveland: a founding silo of run run-1"),
        ("mayo", "--silo mayo: not a silo of data.source=heart_disease"),
    ],
)
def test_a_founder_or_an_unknown_silo_cannot_join(job, silo, message):
    trained = _trained(job)
    with pytest.raises(ConfigError) as error:
        joining_config(trained, job(JOB, "tracking.enabled=false"), silo)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


@pytest.mark.parametrize("algorithm", sorted(a for a in ALGORITHMS if a != "local"))
def test_adapt_keeps_the_global_keys_frozen_and_trains_the_rest(job, algorithm):
    if ALGORITHMS[algorithm].__module__.startswith("tests."):
        pytest.skip("a test plugin's algorithm")
    try:
        trained = _trained(job, f"algorithm.name={algorithm}")
    except ConfigError as refusal:  # e.g. fedbn on an mlp: refused at load, in one line
        pytest.skip(str(refusal))
    silo = _joining(job, trained)
    before = {k: v.clone() for k, v in silo.model.state_dict().items()}
    personal = {k: v.clone() for k, v in silo.algorithm.local_state().items()}
    metrics = silo.adapt(trained.global_state, 1)
    after = silo.model.state_dict()
    for key in silo.split.global_keys:
        assert np.array_equal(after[key].numpy(), trained.global_state[key]), key
    changed = [k for k in silo.split.local_keys if not torch.equal(before[k], after[k])]
    changed += [
        k
        for k, v in silo.algorithm.local_state().items()
        if k not in personal or not torch.equal(personal[k], v)
    ]
    evaluated = silo.evaluate(trained.global_state, 1)
    assert np.isfinite(evaluated.val_accuracy)
    if silo.split.local_keys or silo.algorithm.local_state():
        assert changed, "adapt trained nothing of the silo's own"
        assert np.isfinite(metrics.train_loss), "what adapt trained has a loss"
    assert metrics.bytes_sent == 0


def test_the_onboarding_report_compares_with_the_founders_and_the_baseline(job):
    trained = _trained(job)  # founders: cleveland 0.8, hungarian 0.7
    joined = SiloOutcome("va", 3, 0.9, 0.6, 0.55)
    alone = SiloOutcome("va", 2, 0.8, 0.5, 0.5)
    report = onboard_report("va", trained, joined, alone)
    assert report["founders_mean_test_accuracy"] == pytest.approx(0.75)
    assert report["founders_worst_test_accuracy"] == 0.7
    assert report["share_of_founders_mean"] == pytest.approx(0.6 / 0.75)
    assert report["gain_over_alone"] == pytest.approx(0.1) and report["alone_selected_round"] == 2
    failed = {"silos": {"cleveland": {"test_accuracy": 0.0}, "hungarian": {"test_accuracy": 0.0}}}
    zero = dataclasses.replace(trained, result=failed)  # founders that all scored 0
    assert np.isnan(onboard_report("va", zero, joined, None)["share_of_founders_mean"])
