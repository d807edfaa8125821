"""The Model Registry side: names, the champion alias, and the listing behind `silo-pfl models`.

Each silo's personalized model is registered as `<federation>-<silo>`. Aliases:
  champion  the version with the best validation accuracy so far; moved only when a new version
            beats the champion version's `val_accuracy` tag.
  latest    the newest version. MLflow reserves this alias and resolves it by itself, so
            `models:/<name>@latest` always works and needs no update.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlflow import MlflowClient

CHAMPION = "champion"
LATEST = "latest"
# Tags of every registered model and version; the names are what `silo-pfl models` reads.
FEDERATION, SILO, ALGORITHM = "federation", "silo", "algorithm"
RUN_ID, ROUND = "run_id", "round"
VAL_ACCURACY, TEST_ACCURACY = "val_accuracy", "test_accuracy"


def model_name(federation: str, silo: str) -> str:
    """The registered name of a silo's personalized model."""
    return f"{federation}-{silo}"


def _float(tags: dict[str, str], key: str) -> float:
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
        best = _float(champion.tags, VAL_ACCURACY)
        if not math.isnan(best) and not val_accuracy > best:
            return False
    client.set_registered_model_alias(name, CHAMPION, version)
    return True


@dataclass(frozen=True)
class ModelRow:
    """One registered version of a silo's model, as `silo-pfl models` shows it."""

    federation: str
    silo: str
    name: str
    version: int
    aliases: tuple[str, ...]
    algorithm: str
    val_accuracy: float
    test_accuracy: float

    @property
    def serve_uri(self) -> str:
        """The URI to load or serve this version by: an alias when it has one."""
        alias = next((a for a in (CHAMPION, LATEST) if a in self.aliases), None)
        return f"models:/{self.name}@{alias}" if alias else f"models:/{self.name}/{self.version}"


def model_rows(
    client: MlflowClient, federation: str | None = None, every_version: bool = False
) -> list[ModelRow]:
    """Registered silo models (tagged by silo_pfl), newest version first within each model."""
    rows = []
    for model in client.search_registered_models(max_results=1000, order_by=["name ASC"]):
        fed, silo = model.tags.get(FEDERATION), model.tags.get(SILO)
        if fed is None or silo is None or (federation is not None and fed != federation):
            continue
        versions = client.search_model_versions(f"name = '{model.name}'", max_results=10000)
        versions = sorted(versions, key=lambda v: -int(v.version))
        newest = int(versions[0].version) if versions else 0
        # Versions found by search carry no aliases; the registered model maps alias -> version.
        named = client.get_registered_model(model.name).aliases
        for v in versions:
            number = int(v.version)
            aliases = tuple(sorted(a for a, n in named.items() if int(n) == number))
            aliases += (LATEST,) if number == newest else ()
            if not every_version and not aliases:
                continue
            rows.append(
                ModelRow(
                    federation=fed,
                    silo=silo,
                    name=model.name,
                    version=number,
                    aliases=aliases,
                    algorithm=v.tags.get(ALGORITHM, ""),
                    val_accuracy=_float(v.tags, VAL_ACCURACY),
                    test_accuracy=_float(v.tags, TEST_ACCURACY),
                )
            )
    return rows


def format_table(rows: list[ModelRow]) -> str:
    """A fixed-width table of model rows."""
    header = ("federation", "silo", "version", "aliases", "algorithm", "val acc", "test acc")
    lines = [(*header, "serve")]
    for r in rows:
        lines.append(
            (
                r.federation,
                r.silo,
                str(r.version),
                ",".join(r.aliases) or "-",
                r.algorithm,
                f"{r.val_accuracy:.3f}",
                f"{r.test_accuracy:.3f}",
                r.serve_uri,
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header) + 1)]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip()
        for line in lines
    )


def models_table(uri: str | None, federation: str | None, every_version: bool) -> str:
    """The `silo-pfl models` output for the store at `uri` (default: as tracking.uri)."""
    from silo_pfl.errors import ConfigError
    from silo_pfl.tracking.store import open_client
    from silo_pfl.tracking.uri import redact, resolve_uri, sqlite_path

    key = "--tracking-uri"
    uri = resolve_uri(uri, key)
    path = sqlite_path(uri)
    if path is not None and not path.is_file():
        raise ConfigError(
            f"{key} {redact(uri)}: no MLflow store at {path}; run a federation first, or point "
            f"{key} at its store"
        )
    rows = model_rows(open_client(uri, key), federation, every_version)
    if not rows:
        which = f" of federation {federation}" if federation else ""
        return f"no registered silo models{which} in {redact(uri)}"
    return format_table(rows)


def version_tags(
    federation: str, silo: str, algorithm: str, run_id: str, round_: int, val: float, test: float
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
