"""A trained federation, read back from the tracking store, for a silo that joins it later.

Every federation run logs, on its parent run, `federation.json` (its resolved config, the model's
input shape and number of classes) when it starts, and the server's global keys
(`global_model/global_state.npz`) and `result.json` when it finishes. Those three are what a
joining silo needs: the model, split and algorithm to build, the trained global layers to freeze,
and the founders' figures to compare with. Nothing in them is any silo's local state.
"""

from __future__ import annotations

import io
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from silo_pfl.errors import ConfigError
from silo_pfl.tracking import registry
from silo_pfl.tracking.store import open_existing
from silo_pfl.tracking.uri import redact

if TYPE_CHECKING:
    from mlflow import MlflowClient

FEDERATION_FILE = "federation.json"
GLOBAL_STATE_ARTIFACT = "global_model/global_state.npz"
RESULT_ARTIFACT = "result.json"


@dataclass(frozen=True)
class TrainedRun:
    """What a joining silo takes from a finished federation run."""

    run_id: str
    config: dict[str, Any]  # the run's resolved config (silo_pfl.config.to_dict)
    input_shape: tuple[int, ...]
    num_classes: int
    global_state: dict[str, np.ndarray]
    result: dict[str, Any]  # the run's results JSON: the founders' figures
    columns: str = ""  # the founders' columns digest (messages.columns_digest); "": not recorded

    @property
    def founders(self) -> list[str]:
        return list(self.result.get("silos", {}))


def federation_record(
    config: dict[str, Any], input_shape: tuple[int, ...], n: int, columns: str
) -> str:
    """The text of `federation.json`."""
    record = {
        "config": config,
        "input_shape": list(input_shape),
        "num_classes": n,
        "columns": columns,
    }
    return json.dumps(record, indent=2, default=str)


def _latest(client: MlflowClient, federation: str, uri: str) -> str:
    """The id of the federation's federation run (not an onboarding run) that finished last."""
    experiment = client.get_experiment_by_name(federation)
    if experiment is None:
        raise ConfigError(
            f"onboard: no federation {federation!r} in the tracking store {redact(uri)}; train it "
            "first with `silo-pfl run` (tracking on), or name a run with --from"
        )
    runs = client.search_runs(
        [experiment.experiment_id],
        filter_string=f"attributes.status = 'FINISHED' and tags.{registry.RUN_KIND} = "
        f"'{registry.FEDERATION_RUN}'",
        order_by=["attributes.end_time DESC"],  # a resumed older run may finish last
        max_results=1,
    )
    if not runs:
        raise ConfigError(
            f"onboard: federation {federation!r} has no finished run in {redact(uri)}; finish "
            "one with `silo-pfl run`, or name a run with --from"
        )
    return str(runs[0].info.run_id)


def _artifact(client: MlflowClient, run_id: str, path: str, tmp: str) -> bytes:
    try:
        return Path(client.download_artifacts(run_id, path, tmp)).read_bytes()
    except Exception:
        raise ConfigError(
            f"onboard: run {run_id} has no artifact {path}; onboarding needs a finished "
            "federation run logged by this version of silo-pfl"
        ) from None


def load_trained_run(uri: str, federation: str, run_id: str | None = None) -> TrainedRun:
    """The run `run_id` (`--from`), or the federation's latest finished run, from store `uri`."""
    from mlflow.exceptions import MlflowException

    client, uri = open_existing(uri, "tracking.uri")  # a store runs were logged to, left as is
    if run_id is None:
        run_id = _latest(client, federation, uri)
    try:
        run = client.get_run(run_id)
    except MlflowException:
        raise ConfigError(f"--from {run_id}: no such run in {redact(uri)}") from None
    if run.data.tags.get(registry.RUN_KIND) != registry.FEDERATION_RUN:
        raise ConfigError(f"--from {run_id}: not a federation run (an onboarding or a silo's run)")
    if run.info.status != "FINISHED":
        raise ConfigError(f"--from {run_id}: the run is {run.info.status}, not FINISHED")
    with tempfile.TemporaryDirectory() as tmp:
        record = json.loads(_artifact(client, run_id, FEDERATION_FILE, tmp))
        central = record["config"].get("privacy", {}).get("central_models")
        if central == "none":
            raise ConfigError(
                f"onboard: run {run_id} was trained with privacy.central_models=none: its global "
                "layers are in no store, so no silo can join it; name with --from a run trained "
                "with full or global_only"
            )
        result = json.loads(_artifact(client, run_id, RESULT_ARTIFACT, tmp))
        npz = np.load(io.BytesIO(_artifact(client, run_id, GLOBAL_STATE_ARTIFACT, tmp)))
        global_state = {key: npz[key] for key in npz.files}
    return TrainedRun(
        run_id=run_id,
        config=record["config"],
        input_shape=tuple(record["input_shape"]),
        num_classes=int(record["num_classes"]),
        global_state=global_state,
        result=result,
        columns=str(record.get("columns", "")),  # a run logged before it was recorded: ""
    )
