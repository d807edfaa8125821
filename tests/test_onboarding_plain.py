"""Cold start on the plain classes (no Ray, no MLflow): the joining config and `Silo.adapt`."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from silo_pfl.algorithms import ALGORITHMS
from silo_pfl.config import to_dict, written_keys
from silo_pfl.errors import ConfigError, FederationError
from silo_pfl.messages import SiloOutcome
from silo_pfl.onboarding import alone_config, joining_config, onboard_report
from silo_pfl.server_start import new_server
from silo_pfl.silo import Silo
from silo_pfl.tracking.trained_run import TrainedRun

JOB = "jobs/heart_disease.yaml"
SHAPE, CLASSES = (13,), 2
DIGITS = "jobs/digits_label_skew.yaml"
DIGITS_SHAPE, DIGITS_CLASSES = (1, 8, 8), 10
FEATURE_SHIFT = "jobs/digits_feature_shift.yaml"


def _trained(job, *overrides: str, job_file: str = JOB, late: str = "va") -> TrainedRun:
    """A 'trained' federation without the late silo (hospital va): its initial global keys
    will do."""
    cfg = job(job_file, f"data.late_silos=[{late}]", "tracking.enabled=false", *overrides)
    shape, classes = (SHAPE, CLASSES) if job_file == JOB else (DIGITS_SHAPE, DIGITS_CLASSES)
    server = new_server(to_dict(cfg), shape, classes)
    founders = {"cleveland": {"test_accuracy": 0.8}, "hungarian": {"test_accuracy": 0.7}}
    state = {k: np.array(v) for k, v in server.global_state().items()}
    return TrainedRun("run-1", to_dict(cfg), shape, classes, state, {"silos": founders})


def _joining(
    job, trained: TrainedRun, *overrides: str, job_file: str = JOB, late: str = "va"
) -> Silo:
    algorithm = f"algorithm.name={trained.config['algorithm']['name']}"
    mine = job(job_file, "tracking.enabled=false", algorithm, *overrides)
    cfg = joining_config(trained, mine, late)
    silo = Silo(to_dict(cfg), late)
    silo.setup()
    silo.build(trained.input_shape, trained.num_classes, joining=True)
    return silo


def test_the_trained_run_decides_model_split_and_algorithm(job):
    trained = _trained(job, "algorithm.name=fedrep", "model.hidden=[16,8]", "split.local=[last:2]")
    mine = job(JOB, "tracking.enabled=false", "algorithm.name=fedrep", "rounds=3", "train.lr=0.1")
    cfg = joining_config(trained, mine, "va")
    assert cfg.algorithm["name"] == "fedrep" and list(cfg.model.hidden) == [16, 8]
    assert list(cfg.split.local) == ["last:2"]
    assert cfg.rounds == 3 and cfg.train.lr == 0.1
    alone = alone_config(cfg)
    assert alone.algorithm["name"] == "local" and alone.split.local is None
    assert alone.rounds == 3 and list(alone.model.hidden) == [16, 8]


@pytest.mark.parametrize(
    ("trained_secure", "mine_secure", "counted"),
    [(False, False, True), (True, False, False), (False, True, False)],
    ids=["plain", "trained-secure", "job-secure"],
)
def test_a_silo_joining_a_secure_federation_keeps_its_rows_per_class(
    job, trained_secure, mine_secure, counted
):
    """Its founders' counts never left them (aggregation.secure); the joining silo, which sends
    nothing to mask and so runs with secure off, keeps its counts too."""
    trained = _trained(job, f"aggregation.secure={trained_secure}")
    mine = job(JOB, "tracking.enabled=false", f"aggregation.secure={mine_secure}")
    cfg = joining_config(trained, mine, "va")
    assert not cfg.aggregation.secure
    silo = Silo(to_dict(cfg), "va")
    assert bool(silo.setup().label_counts) is counted


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["algorithm.name=fedavg"], "algorithm.name: got 'fedavg', but run run-1 was trained with"),
        ([], "algorithm.name: got 'fedper', but run run-1 was trained with 'fedrep'"),  # the job's
        (["algorithm.name=fedrep", "model.hidden=[64]"], "model.hidden: got [64], but run run-1"),
        (["algorithm.name=fedrep", "split.local=[first:1]"], "split.local: got ['first:1'], but"),
        (["algorithm.name=fedrep", "server.lr=0.5"], "server.lr: got 0.5, but run run-1 was"),
        (["algorithm.name=fedrep", "algorithm.fedrep.head_epochs=3"], "algorithm.fedrep.head_e"),
    ],
)
def test_a_federation_setting_the_user_gives_other_than_the_trained_runs_is_refused(
    job, overrides, message
):
    trained = _trained(job, "algorithm.name=fedrep", "algorithm.fedrep.head_epochs=2")
    with pytest.raises(ConfigError) as error:
        joining_config(trained, job(JOB, "tracking.enabled=false", *overrides), "va")
    assert str(error.value).startswith(message) and "\n" not in str(error.value)
    assert "the trained run decides" in str(error.value)


def test_the_keys_the_user_wrote_are_compared_at_any_value(job):
    """Given the keys written (config.written_keys), even one at its default is compared."""
    trained = _trained(job, "model.hidden=[16,8]")
    overrides = ["tracking.enabled=false", "model.hidden=[32]"]  # the default, written
    mine = job(JOB, *overrides)
    assert list(joining_config(trained, mine, "va").model.hidden) == [16, 8]
    with pytest.raises(ConfigError, match=r"^model\.hidden: got \[32\], but run run-1 was"):
        joining_config(trained, mine, "va", written_keys(None, overrides))


@pytest.mark.parametrize(
    ("job_file", "override", "message"),
    [
        (JOB, "seed=1", "seed: got 1, but run run-1 was trained with 0;"),
        (JOB, "data.val_fraction=0.3", "data.val_fraction: got 0.3, but run run-1 was trained"),
        (DIGITS, "data.num_silos=8", "data.num_silos: got 8, but run run-1 was trained with 10"),
        (DIGITS, "data.partition=iid", "data.partition: got 'iid', but run run-1 was trained"),
        (DIGITS, "data.alpha=0.1", "data.alpha: got 0.1, but run run-1 was trained with 0.5"),
        (DIGITS, "data.classes_per_silo=3", "data.classes_per_silo: got 3, but run run-1 was"),
    ],
)
def test_a_seed_or_data_split_other_than_the_trained_runs_is_refused(
    job, job_file, override, message
):
    silo = "va" if job_file == JOB else "silo_7"
    trained = _trained(job, job_file=job_file, late=silo)
    with pytest.raises(ConfigError) as error:
        joining_config(trained, job(job_file, "tracking.enabled=false", override), silo)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)
    assert "only data.late_silos, data.max_train_rows, data.paths" in str(error.value)
    own = job(job_file, "tracking.enabled=false", "data.max_train_rows=20")  # no late silos
    cfg = joining_config(trained, own, silo)
    assert cfg.data.max_train_rows == 20 and cfg.data.late_silos == []


@pytest.mark.parametrize(
    ("silo", "message"),
    [
        ("cleveland", "silo cleveland: a founding silo of run run-1"),
        ("mayo", "silo mayo: not a silo of data.source=heart_disease"),
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
    # fedbn keeps the BatchNorm keys: the hospitals' mlp has none, digits' cnn_small_bn has.
    where = {"job_file": FEATURE_SHIFT, "late": "silo_7"} if algorithm == "fedbn" else {}
    trained = _trained(job, f"algorithm.name={algorithm}", **where)
    silo = _joining(job, trained, **where)
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


def test_a_joining_silo_with_one_batch_a_round_is_not_held_to_meta_steps_it_never_takes(job):
    """perfedavg's meta-step takes 2 batches, so a founder with 1 a round is refused. A silo
    joining keeps every key frozen (no local keys) and only adapts as it evaluates, which one
    batch does: it was refused all the same, told to raise train.local_epochs, which would do
    nothing for it."""
    few = ("data.max_train_rows=10", "train.local_epochs=1")
    trained = _trained(job, "algorithm.name=perfedavg")
    silo = _joining(job, trained, *few)
    assert not silo.split.local_keys
    silo.adapt(trained.global_state, 1)
    assert np.isfinite(silo.evaluate(trained.global_state, 1).val_accuracy)
    founder = Silo(to_dict(job(JOB, "algorithm.name=perfedavg", *few)), "cleveland")
    info = founder.setup()
    with pytest.raises(FederationError, match=r"silo cleveland: its 10 training rows make 1 batch"):
        founder.build(info.input_shape, info.num_classes)


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


def test_without_from_a_silo_joins_the_run_that_finished_last(tmp_path):
    """An older run resumed to more rounds finishes after a newer one: "the latest finished
    run" is the older one, which the search by start time passed over."""
    from mlflow import MlflowClient

    from silo_pfl.tracking import registry
    from silo_pfl.tracking.trained_run import _latest

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    experiment = client.create_experiment("heart_disease")
    tags = {registry.RUN_KIND: registry.FEDERATION_RUN}
    older = client.create_run(experiment, tags=tags, start_time=1_000).info.run_id
    newer = client.create_run(experiment, tags=tags, start_time=2_000).info.run_id
    client.set_terminated(newer, end_time=3_000)
    client.set_terminated(older, end_time=4_000)  # resumed, then finished
    assert _latest(client, "heart_disease", uri) == older


def test_a_run_trained_with_a_plugins_algorithm_brings_its_plugins(job):
    """The trained run's plugins come with its algorithm: a job that names none is told which
    algorithm the run was trained with (before: the plugin's algorithm name, which the user
    never wrote, refused as not built in), and one that names others gets the run's as well."""
    trained = _trained(job, "plugins=[tests.strategy_plugins]", "algorithm.name=median_fedavg")
    mine = job(JOB, "tracking.enabled=false")
    with pytest.raises(ConfigError, match="^algorithm.name: got 'fedper', but run run-1 was"):
        joining_config(trained, mine, "va")
    other = "plugins=[tests.canary_plugins]"
    mine = job(JOB, "tracking.enabled=false", other, "algorithm.name=median_fedavg")
    cfg = joining_config(trained, mine, "va")
    assert cfg.algorithm["name"] == "median_fedavg"
    assert list(cfg.plugins) == ["tests.canary_plugins", "tests.strategy_plugins"]
    # The run's other plugins may be the founders' own, importable on their nodes only: a
    # built-in algorithm takes none of them, a plugin's those that import here.
    trained.config["plugins"] = ["tests.strategy_plugins", "founders_site.hooks"]
    cfg = joining_config(trained, mine, "va")
    assert list(cfg.plugins) == ["tests.canary_plugins", "tests.strategy_plugins"]
    trained = _trained(job, "plugins=[tests.strategy_plugins]")
    trained.config["plugins"] = ["founders_site.hooks"]
    assert list(joining_config(trained, job(JOB, "tracking.enabled=false"), "va").plugins) == []


@pytest.mark.parametrize(
    ("founders", "mine", "joined"),
    [
        (("global_only", False), ("full", True), ("global_only", False)),
        (("full", True), ("global_only", True), ("global_only", True)),
        (("global_only", True), ("none", False), ("none", False)),
    ],
    ids=["founders-stricter", "silo-stricter", "silo-strictest"],
)
def test_a_joining_silo_keeps_out_of_the_central_store_what_the_founders_kept_out(
    job, founders, mine, joined
):
    """Before, a job at the defaults (full) sent the joining silo's personalized model and its
    rows per class to the central store of a federation trained with global_only."""

    def privacy(central: str, counts: bool) -> list[str]:
        return [f"privacy.central_models={central}", f"privacy.label_counts={counts}"]

    trained = _trained(job, *privacy(*founders))
    cfg = joining_config(trained, job(JOB, "tracking.enabled=false", *privacy(*mine)), "va")
    assert (cfg.privacy.central_models, cfg.privacy.label_counts) == joined
