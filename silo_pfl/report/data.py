"""A tracked federation run read back from its MLflow store into plain data for the report
(`read_run`), or the same data from the run itself as it ends (`from_result`).

Per silo, from its child run: validation and test accuracy and bytes sent per round (step =
round), and its selected model's round and accuracies. From the parent run: its tags, params
(the rounds from its `rounds` tag, which a resume updates, else the param of older runs)
and final metrics, and the artifacts `split.json` and `partition.json` (absent under
aggregation.secure: the silos report no counts then).
"""

from __future__ import annotations

import json
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from silo_pfl.errors import ConfigError
from silo_pfl.run_dir import RUN_ID
from silo_pfl.tracking import registry
from silo_pfl.tracking.tracker import PARENT_RUN_TAG, PARTITION_FILE, ROUNDS_TAG

if TYPE_CHECKING:
    from mlflow import MlflowClient

    from silo_pfl.results import FederationResult

SPLIT_FILE = "split.json"
SERIES = ("val_accuracy", "test_accuracy", "bytes_sent")


@dataclass(frozen=True)
class SiloSeries:
    """One silo of a run: its metrics per round and its selected model."""

    name: str
    rounds: tuple[int, ...]
    val_accuracy: tuple[float, ...]
    test_accuracy: tuple[float, ...]
    bytes_sent: dict[int, float]  # round -> bytes it sent that round
    selected_round: int | None  # None (accuracies NaN): the run ended before the silo selected
    selected_val_accuracy: float
    selected_test_accuracy: float


@dataclass(frozen=True)
class RunData:
    """What the report shows of one federation run."""

    run_id: str
    federation: str
    algorithm: str
    seed: str
    rounds: int
    wall_seconds: float
    secure: bool
    silos: dict[str, SiloSeries]
    split: dict[str, Any] = field(default_factory=dict)  # split.json; empty if not logged
    partition: dict[str, list[int]] | None = None  # silo -> training rows per class
    status: str = "FINISHED"  # MLflow's: RUNNING, KILLED or FAILED for a run that did not end

    @property
    def selected(self) -> list[str]:
        """The silos that kept a selected model: none where the run did not finish."""
        return [name for name, s in self.silos.items() if s.selected_round is not None]

    @property
    def selected_test(self) -> np.ndarray:
        return np.array([s.selected_test_accuracy for s in self.silos.values()])

    @property
    def mean_test(self) -> float:
        return float(np.mean(self.selected_test))

    @property
    def worst_test(self) -> float:
        return float(np.min(self.selected_test))

    @property
    def std_test(self) -> float:
        return float(np.std(self.selected_test))


def silo_order(name: str) -> tuple[Any, ...]:
    """Natural order: silo_2 before silo_10."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


def _artifact_json(client: MlflowClient, run_id: str, path: str) -> Any:
    """A JSON artifact of the run, or None when the run has none at `path`."""
    names = {a.path for a in client.list_artifacts(run_id)}
    if path not in names:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        return json.loads(Path(client.download_artifacts(run_id, path, tmp)).read_text())


def _series(client: MlflowClient, run: Any) -> SiloSeries:
    """A silo's child run: its round metrics and its selected model's."""
    run_id, metrics = run.info.run_id, run.data.metrics
    history = {key: client.get_metric_history(run_id, key) for key in SERIES}
    val = {m.step: m.value for m in history["val_accuracy"]}
    test = {m.step: m.value for m in history["test_accuracy"]}
    rounds = tuple(sorted(set(val) & set(test)))
    return SiloSeries(
        name=run.data.tags[registry.SILO],
        rounds=rounds,
        val_accuracy=tuple(val[r] for r in rounds),
        test_accuracy=tuple(test[r] for r in rounds),
        bytes_sent={m.step: m.value for m in history["bytes_sent"]},
        selected_round=int(metrics["selected_round"]) if "selected_round" in metrics else None,
        selected_val_accuracy=float(metrics.get("selected_val_accuracy", np.nan)),
        selected_test_accuracy=float(metrics.get("selected_test_accuracy", np.nan)),
    )


def get_parent(client: MlflowClient, run_id: str, key: str, where: str) -> Any:
    """The MLflow run `run_id`, checked to be a federation's parent run; one-line errors."""
    from mlflow.exceptions import MlflowException

    try:
        run = client.get_run(run_id)
    except MlflowException:
        hint = ""
        if RUN_ID.fullmatch(run_id):  # a user may give a run directory's id for its MLflow run's
            hint = (
                "; that is a run's directory id: give its MLflow run id, printed as `mlflow: run "
                "<id>` and in the results' mlflow.run_id"
            )
        raise ConfigError(f"{key} {run_id}: no such run in {where}{hint}") from None
    experiment = client.get_experiment(run.info.experiment_id)
    if experiment.lifecycle_stage == "deleted":
        raise ConfigError(
            f"{key} {run_id}: its experiment {experiment.name} is deleted in {where}; restore it "
            f"first (mlflow experiments restore --experiment-id {experiment.experiment_id})"
        )
    if run.info.lifecycle_stage == "deleted":
        raise ConfigError(
            f"{key} {run_id}: the run is deleted in {where}; restore it first "
            f"(mlflow runs restore --run-id {run_id})"
        )
    tags = run.data.tags
    if PARENT_RUN_TAG in tags or registry.FEDERATION not in tags:
        raise ConfigError(
            f"{key} {run_id}: not a federation run (a silo's run, or not logged by silo-pfl); "
            "name the parent run that `silo-pfl run` printed"
        )
    return run


def read_run(client: MlflowClient, run_id: str, key: str = "RUN_ID", where: str = "") -> RunData:
    """Read a federation's parent run and its silos' child runs from the store."""
    run = get_parent(client, run_id, key, where or "the tracking store")
    children = client.search_runs(
        [run.info.experiment_id],
        filter_string=f"tags.{PARENT_RUN_TAG} = '{run_id}'",
        max_results=10000,
    )
    series = [_series(client, child) for child in children if registry.SILO in child.data.tags]
    if not series:
        raise ConfigError(f"{key} {run_id}: the run has no silo runs; it logged no round")
    params, tags = run.data.params, run.data.tags
    partition = _artifact_json(client, run_id, PARTITION_FILE)
    return RunData(
        run_id=run_id,
        federation=tags[registry.FEDERATION],
        algorithm=tags.get(registry.ALGORITHM, params.get("algorithm.name", "")),
        seed=params.get("seed", ""),
        rounds=int(tags.get(ROUNDS_TAG, params.get("rounds", 0))),  # the tag: a resume's rounds
        wall_seconds=float(run.data.metrics.get("wall_seconds", np.nan)),
        secure=params.get("aggregation.secure", "False") == "True",
        silos={s.name: s for s in sorted(series, key=lambda s: silo_order(s.name))},
        split=_artifact_json(client, run_id, SPLIT_FILE) or {},
        partition=None if partition is None else dict(partition["silos"]),
        status=run.info.status,
    )


def from_result(
    result: FederationResult,
    run_id: str,
    secure: bool,
    split: dict[str, Any],
    partition: dict[str, list[int]] | None,
) -> RunData:
    """What `read_run` reads back of a run, from the run itself as it ends: its history holds
    every figure its silos' child runs log, round by round. `split` is split.json's content."""
    series = []
    for name, outcome in result.silos.items():
        figures = {s.round: s.silos[name] for s in result.history if name in s.silos}
        rounds = tuple(r for r, f in figures.items() if "val_accuracy" in f)  # evaluated ones
        series.append(
            SiloSeries(
                name=name,
                rounds=rounds,
                val_accuracy=tuple(float(figures[r]["val_accuracy"]) for r in rounds),
                test_accuracy=tuple(float(figures[r]["test_accuracy"]) for r in rounds),
                bytes_sent={r: float(f["bytes_sent"]) for r, f in figures.items()},
                selected_round=int(outcome.selected_round),
                selected_val_accuracy=float(outcome.val_accuracy),
                selected_test_accuracy=float(outcome.test_accuracy),
            )
        )
    return RunData(
        run_id=run_id,
        federation=result.name,
        algorithm=result.algorithm,
        seed=str(result.seed),
        rounds=int(result.rounds),
        wall_seconds=float(result.wall_seconds),
        secure=secure,
        silos={s.name: s for s in sorted(series, key=lambda s: silo_order(s.name))},
        split=split,
        partition=partition,
    )


def check_against(run: RunData, against: RunData) -> None:
    """The run to compare with is another run of the same federation, and both selected their
    silos' models (a run that did not finish has none to compare)."""
    if against.run_id == run.run_id:
        raise ConfigError(f"--against {against.run_id}: that is the run itself; name another run")
    for which in (against, run):
        if not which.selected:
            raise ConfigError(
                f"--against {against.run_id}: run {which.run_id} did not finish ({which.status}): "
                "it has no selected models to compare"
            )
    if against.federation != run.federation:
        raise ConfigError(
            f"--against {against.run_id}: a run of federation {against.federation!r}, not "
            f"{run.federation!r}; compare runs of the same federation"
        )
    if not set(run.silos) & set(against.silos):
        raise ConfigError(
            f"--against {against.run_id}: its silos ({', '.join(sorted(against.silos))}) share "
            "none with this run's; compare runs with silos in common"
        )
