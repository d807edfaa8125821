"""The Model Registry side: names, tags, the one registration path and the champion alias.

Each silo's personalized model is registered as `<federation>-<silo>`. Aliases:
  champion  the version with the best validation accuracy so far; moved only when a new version
            beats the champion version's `val_accuracy` tag.
  latest    the newest version. MLflow reserves this alias and resolves it by itself, so
            `models:/<name>@latest` always works and needs no update.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlflow import MlflowClient

CHAMPION = "champion"
LATEST = "latest"
# Tags of every registered model and version; the names are what `silo-pfl models` reads.
FEDERATION, SILO, ALGORITHM = "federation", "silo", "algorithm"
RUN_ID, ROUND = "run_id", "round"
VAL_ACCURACY, TEST_ACCURACY = "val_accuracy", "test_accuracy"
# How the silo joined: with the federation that trained (founder), or later (onboard).
JOINED, FOUNDER, ONBOARD = "joined", "founder", "onboard"
# A parent run's kind: a federation's training, or a silo's onboarding onto a trained one.
RUN_KIND, FEDERATION_RUN, ONBOARD_RUN = "run_kind", "federation", "onboard"


def model_name(federation: str, silo: str) -> str:
    """The registered name of a silo's personalized model."""
    return f"{federation}-{silo}"


def tag_value(tags: dict[str, str], key: str) -> float:
    """A float tag (e.g. val_accuracy), NaN when absent or not a number."""
    try:
        return float(tags.get(key, "nan"))
    except ValueError:
        return math.nan


def promote(client: MlflowClient, name: str, version: str, val_accuracy: float) -> bool:
    """Point `champion` at `version` if it beats the champion's validation accuracy tag."""
    from mlflow.exceptions import MlflowException

    try:
        champion = client.get_model_version_by_alias(name, CHAMPION)
    except MlflowException:
        champion = None
    if champion is not None:
        best = tag_value(champion.tags, VAL_ACCURACY)
        if not math.isnan(best) and not val_accuracy > best:
            return False
    client.set_registered_model_alias(name, CHAMPION, version)
    return True


def version_tags(
    federation: str,
    silo: str,
    algorithm: str,
    run_id: str,
    round_: int,
    val: float,
    test: float,
    joined: str = FOUNDER,
) -> dict[str, str]:
    """The tags of a registered version; accuracies as exact float reprs."""
    return {
        FEDERATION: federation,
        SILO: silo,
        ALGORITHM: algorithm,
        RUN_ID: run_id,
        ROUND: str(round_),
        VAL_ACCURACY: repr(float(val)),
        TEST_ACCURACY: repr(float(test)),
        JOINED: joined,
    }


def register(
    client: MlflowClient, name: str, model_id: str, location: str, tags: dict[str, str]
) -> str:
    """A new version of registered model `name` (created on first use); returns its number.

    The source is the logged model's artifact location, not `models:/<id>`: MLflow would resolve
    that through the process-wide tracking URI, which need not be this client's store.
    """
    import json

    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import RESOURCE_ALREADY_EXISTS, ErrorCode
    from mlflow.utils.mlflow_tags import MLFLOW_MODEL_VERSIONS

    federation, silo = tags[FEDERATION], tags[SILO]
    try:
        client.create_registered_model(
            name,
            tags={FEDERATION: federation, SILO: silo},
            description=f"Personalized model of silo {silo} in federation {federation}: "
            "the global layers and the silo's own local layers.",
        )
    except MlflowException as exc:
        if exc.error_code != ErrorCode.Name(RESOURCE_ALREADY_EXISTS):
            raise
    version = client.create_model_version(
        name, source=location, run_id=tags[RUN_ID], tags=tags, model_id=model_id
    )
    link = [{"name": name, "version": version.version}]
    client.set_logged_model_tags(model_id, {MLFLOW_MODEL_VERSIONS: json.dumps(link)})
    return str(version.version)


def publish(
    client: MlflowClient, name: str, model_id: str, location: str, tags: dict[str, str]
) -> dict[str, str]:
    """The one registration path, for the tracker and for a silo's own store alike.

    A logged model whose files are written becomes READY and an output of its run at its round,
    then a new version of `name`, then champion if it beats the current one.
    """
    from mlflow.entities import LoggedModelOutput, LoggedModelStatus

    client.finalize_logged_model(model_id, LoggedModelStatus.READY)
    step = int(tags[ROUND])
    client.log_outputs(tags[RUN_ID], [LoggedModelOutput(model_id, step=step)])
    version = register(client, name, model_id, location, tags)
    champion = promote(client, name, version, float(tags[VAL_ACCURACY]))
    return {
        "model_uri": f"models:/{name}/{version}",
        "registered_model": name,
        "version": version,
        "champion": str(champion).lower(),
    }
