"""A run that fails after its export (in on_end's uploads, say) is resumable, and its resume
exports again: that export reuses the version the first attempt registered for the same run and
round, and a silo's restart is counted once. Without Ray: MlflowTracker is driven in the
orchestrator's hook order, with a real Silo exporting, as a first driver and then a resume."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import pytest
from mlflow import MlflowClient

from silo_pfl.config import FederationConfig, to_dict
from silo_pfl.messages import SplitInfo
from silo_pfl.results import RoundSummary
from silo_pfl.server_start import new_server
from silo_pfl.settings import load_config
from silo_pfl.silo import Silo
from silo_pfl.tracking.exporter import MlflowExporter
from silo_pfl.tracking.registry import CHAMPION, LATEST, model_name
from silo_pfl.tracking.tracker import MlflowTracker

SILO = "hungarian"
ROUNDS = 3
RESTARTED_IN = 2  # the round in which the silo's process died and it rejoined, once


def _summary(round_: int) -> RoundSummary:
    """Round `round_` as the driver saw it: the one silo took part; it restarted in one round."""
    restarted = {SILO: {"round": round_ - 1, "local_digest": "d", "pid": 1}}
    return RoundSummary(
        round=round_,
        seconds=0.1,
        mean_train_loss=0.1,
        mean_val_accuracy=0.5,
        mean_test_accuracy=0.5,
        silos={SILO: {"train_loss": 0.1, "val_accuracy": 0.5, "test_accuracy": 0.5}},
        participants=[SILO],
        restarted=restarted if round_ == RESTARTED_IN else {},
    )


@dataclass
class Resumed:
    """The two drivers of one run, the silo they exported from, and what the store held."""

    cfg: FederationConfig
    store: str
    silo: Silo
    first: MlflowTracker
    second: MlflowTracker
    restarts_before: str | None  # the child run's restarts tag once the first driver stopped


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> Resumed:
    """A 3-round run whose first driver exports, registers and then fails (as when on_end's
    uploads do); then its --resume, from the tracker state checkpointed at round 3."""
    tmp = tmp_path_factory.mktemp("resumed")
    store = f"sqlite:///{tmp / 'mlflow.db'}"
    overrides = [f"output_dir={tmp / 'runs'}", f"tracking.uri={store}", f"rounds={ROUNDS}"]
    overrides += ["round.min_silos=1", "tracking.report=false"]
    overrides += ["data.late_silos=[cleveland,switzerland,va]"]  # a federation of one silo
    cfg = load_config("jobs/heart_disease.yaml", overrides)
    silo = Silo(to_dict(cfg), SILO)
    info = silo.setup()
    silo.build(info.input_shape, info.num_classes)
    server = new_server(to_dict(cfg), info.input_shape, info.num_classes)
    split = SplitInfo(1, 1, 1)

    first = MlflowTracker(cfg)
    first.on_start(cfg, [info], split)
    silo.attach({"0": first.exporters([info])[SILO]})
    history: list[RoundSummary] = []
    saved: dict[str, Any] = {}
    for round_ in range(1, ROUNDS + 1):
        update, _ = silo.fit(server.global_state(), round_)
        assert server.aggregate(update).aggregated
        silo.evaluate(server.global_state(), round_)
        silo.commit(round_, keep=True)
        history.append(_summary(round_))
        saved = copy.deepcopy(first.state())  # the orchestrator checkpoints, then on_round_end
        first.on_round_end(history[-1])
    first.on_exported({SILO: silo.export()["0"]})
    first.abort()  # on_end failed: no result.json, so the run resumes
    before = first.client.get_run(first.children[SILO]).data.tags.get("restarts")

    second = MlflowTracker(cfg)
    second.restore(saved)
    second.on_start(cfg, [info], split)
    silo.attach({"0": second.exporters([info])[SILO]})
    second.on_resumed(history)
    second.on_exported({SILO: silo.export()["0"]})
    return Resumed(cfg, store, silo, first, second, before)


def test_a_resume_after_the_export_reuses_the_registered_version(resumed):
    client = MlflowClient(resumed.store)
    name = model_name(resumed.cfg.name, SILO)
    versions = client.search_model_versions(f"name = '{name}'")
    assert [str(v.version) for v in versions] == ["1"]
    assert versions[0].run_id == resumed.first.children[SILO] == resumed.second.children[SILO]
    assert resumed.second.receipts == resumed.first.receipts  # the same receipt, model and all
    assert resumed.first.receipts[SILO]["model_uri"] == f"models:/{name}/1"
    for alias in (CHAMPION, LATEST):
        assert str(client.get_model_version_by_alias(name, alias).version) == "1"
    # The resume's logged model, a copy of the version's files, is not left behind.
    logged = client.search_logged_models(experiment_ids=[resumed.second.experiment_id])
    assert [m.model_id for m in logged] == [resumed.first.receipts[SILO]["model_id"]]
    assert [str(m.status) for m in logged] == ["READY"]


def test_one_restart_is_one_in_the_restarts_tag_after_a_resume(resumed):
    client = MlflowClient(resumed.store)
    assert resumed.restarts_before == "1"
    tags = client.get_run(resumed.second.children[SILO]).data.tags
    assert tags["restarts"] == "1"
    assert tags[f"round_{RESTARTED_IN}_restored"] == "d"


def test_an_export_to_a_silos_own_store_is_idempotent_per_federation_run(resumed, tmp_path):
    """Each export makes a run in the silo's store: the resumed run's export finds the version
    by its run's federation run; another federation run's export is a new version."""
    store = f"sqlite:///{tmp_path / 'own.db'}"
    key = f"silos.{SILO}.tracking_uri"
    run_id = resumed.second.run_id
    receipts = []
    for parent in (run_id, run_id, "another_run"):
        resumed.silo.attach({"own": MlflowExporter(store, key, resumed.cfg.name, parent)})
        receipts.append(resumed.silo.export()["own"])
    assert receipts[1] == receipts[0]
    name = model_name(resumed.cfg.name, SILO)
    assert [r["model_uri"] for r in receipts] == [f"models:/{name}/{v}" for v in (1, 1, 2)]
    client = MlflowClient(store)
    assert len(client.search_model_versions(f"name = '{name}'")) == 2
    experiment = client.get_experiment_by_name(resumed.cfg.name).experiment_id
    runs = client.search_runs([experiment])
    assert len(runs) == 2 and {r.info.status for r in runs} == {"FINISHED"}
