"""A run's final figures are logged once. A run stopped (Ctrl-C, SIGTERM) after on_end logged
them but before its result.json was written is not finished, so its --resume ends again: its
final figures must not be logged a second time. Each child's selected_* figures go at
step=rounds, so a resume that raises the rounds adds a point at its own last round. And a resume
whose MLflow run was deleted meanwhile stops in one line naming the command that restores it.

Without Ray: MlflowTracker is driven in the orchestrator's hook order, over a real SQLite
store, as a first driver and then a resume from the tracker state it checkpointed."""

from __future__ import annotations

from typing import Any

import pytest
from mlflow import MlflowClient

from silo_pfl.config import FederationConfig
from silo_pfl.errors import ConfigError
from silo_pfl.messages import SiloInfo, SplitInfo
from silo_pfl.results import FederationResult, RoundSummary, SiloResult
from silo_pfl.settings import load_config
from silo_pfl.tracking.tracker import FINAL_METRICS, MlflowTracker

SILOS = ("cleveland", "hungarian")
SPLIT = SplitInfo(10, 5, 40)
SELECTED = ("selected_round", "selected_val_accuracy", "selected_test_accuracy")


def _config(tmp_path: Any, rounds: int) -> FederationConfig:
    overrides = [f"output_dir={tmp_path / 'runs'}", f"rounds={rounds}"]
    overrides += [f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}", "tracking.report=false"]
    overrides += ["round.min_silos=1", "data.late_silos=[switzerland,va]"]
    return load_config("jobs/heart_disease.yaml", overrides)


def _infos() -> list[SiloInfo]:
    return [SiloInfo(s, 100, 20, 30, (13,), 2, columns="c") for s in SILOS]


def _summary(round_: int) -> RoundSummary:
    figures = {"train_loss": 0.5, "val_accuracy": 0.7, "test_accuracy": 0.7}
    return RoundSummary(
        round=round_,
        seconds=0.1,
        mean_train_loss=0.5,
        mean_val_accuracy=0.7,
        mean_test_accuracy=0.7,
        silos={s: dict(figures) for s in SILOS},
        participants=list(SILOS),
    )


def _result(cfg: FederationConfig, history: list[RoundSummary], selected: int) -> FederationResult:
    silo = SiloResult(
        test_accuracy=0.8,
        val_accuracy=0.75,
        selected_round=selected,
        final_test_accuracy=0.78,
        num_train=100,
        num_val=20,
        num_test=30,
        bytes_sent_per_round=40,
    )
    return FederationResult(
        name=cfg.name,
        algorithm=cfg.algorithm["name"],
        rounds=cfg.rounds,
        seed=cfg.seed,
        wall_seconds=1.5,
        global_parameters=10,
        local_parameters=5,
        silos=dict.fromkeys(SILOS, silo),
        history=history,
    )


def _first_driver(cfg: FederationConfig) -> tuple[MlflowTracker, dict[str, Any], list]:
    """A run of cfg.rounds rounds that ends (on_end logs its final figures) and is then
    interrupted before its result.json: abort(killed=True). Its checkpointed tracker state."""
    tracker = MlflowTracker(cfg)
    tracker.on_start(cfg, _infos(), SPLIT)
    history: list[RoundSummary] = []
    saved: dict[str, Any] = {}
    for round_ in range(1, cfg.rounds + 1):
        history.append(_summary(round_))
        saved = dict(tracker.state())  # the orchestrator checkpoints, then on_round_end
        tracker.on_round_end(history[-1])
    tracker.on_end(_result(cfg, history, selected=1))
    tracker.abort(killed=True)  # Ctrl-C before result.json: the run is not finished
    return tracker, saved, history


def _resume(cfg: FederationConfig, saved: dict[str, Any], history: list) -> MlflowTracker:
    tracker = MlflowTracker(cfg)
    tracker.restore(saved)
    tracker.on_start(cfg, _infos(), SPLIT)
    tracker.on_resumed(list(history))
    return tracker


def _steps(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def test_a_resume_of_a_run_stopped_after_its_end_logs_the_final_figures_once(tmp_path):
    cfg = _config(tmp_path, 3)
    first, saved, history = _first_driver(cfg)
    second = _resume(cfg, saved, history)
    second.on_end(_result(cfg, history, selected=1))  # no round left: it ends again
    client = MlflowClient(cfg.tracking.uri)
    for key in FINAL_METRICS:
        assert len(_steps(client, first.run_id, key)) == 1, key
    assert _steps(client, first.run_id, "mean_test_accuracy") == [(3, 0.8)]
    for silo in SILOS:
        child = first.children[silo]
        assert _steps(client, child, "selected_round") == [(3, 1.0)]
        for key in SELECTED:
            assert len(_steps(client, child, key)) == 1, (silo, key)
        assert client.get_run(child).info.status == "FINISHED"
    # The rounds' figures are not repeated either.
    assert [m.step for m in client.get_metric_history(first.run_id, "round_seconds")] == [1, 2, 3]


def test_a_resume_with_more_rounds_adds_the_selected_model_at_its_last_round(tmp_path):
    first, saved, history = _first_driver(_config(tmp_path, 3))
    cfg = _config(tmp_path, 5)
    second = _resume(cfg, saved, history)
    for round_ in (4, 5):
        history.append(_summary(round_))
        second.on_round_end(history[-1])
    second.on_end(_result(cfg, history, selected=4))
    client = MlflowClient(cfg.tracking.uri)
    for silo in SILOS:
        assert _steps(client, first.children[silo], "selected_round") == [(3, 1.0), (5, 4.0)]
        assert client.get_run(first.children[silo]).data.metrics["selected_round"] == 4.0
    assert _steps(client, first.run_id, "mean_test_accuracy") == [(3, 0.8), (5, 0.8)]


def test_a_resume_whose_mlflow_run_was_deleted_says_how_to_restore_it(tmp_path):
    cfg = _config(tmp_path, 2)
    tracker = MlflowTracker(cfg)
    tracker.on_start(cfg, _infos(), SPLIT)
    saved = dict(tracker.state())
    tracker.abort(killed=True)
    client = MlflowClient(cfg.tracking.uri)
    deleted = tracker.children[SILOS[1]]
    client.delete_run(deleted)
    resumed = MlflowTracker(cfg)
    resumed.restore(saved)
    with pytest.raises(ConfigError) as raised:
        resumed.on_start(cfg, _infos(), SPLIT)
    message = str(raised.value)
    assert "\n" not in message
    assert f"MLflow run {deleted} is deleted" in message
    assert message.endswith(f"(mlflow runs restore --run-id {deleted})"), message
    # Nothing was reopened: the runs stay as the interrupted run left them.
    assert client.get_run(tracker.run_id).info.status == "KILLED"
