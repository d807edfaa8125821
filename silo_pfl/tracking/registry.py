"""The Model Registry side: names, tags, the one registration path and the champion alias.

Each silo's personalized model is registered as `<federation>-<silo>`. Both names may hold '-', so
two federations can reach one name (`clinic` + `north-a`, `clinic-north` + `a`): the registered
model's tags say whose it is, and a run whose name is another's fails before round 1
(`check_owner`), and `register` refuses to add a version to it. Aliases:
  champion  the version with the best validation accuracy on the newest version's validation
            rows (`val_rows`, a digest of them): a score counts only against scores on the same
            rows. On the same rows as the champion's, a new version takes the alias only when
            it beats it; on other rows (another seed's split, new data), the alias goes to the
            best version scored on those rows, the newest one if it is the only one.
  latest    the newest version. MLflow reserves this alias and resolves it by itself, so
            `models:/<name>@latest` always works and needs no update.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from silo_pfl.errors import ConfigError, FederationError

if TYPE_CHECKING:
    from mlflow import MlflowClient

CHAMPION = "champion"
LATEST = "latest"
# Tags of every registered model and version; the names are what `silo-pfl models` reads.
FEDERATION, SILO, ALGORITHM = "federation", "silo", "algorithm"
RUN_ID, ROUND = "run_id", "round"
MODEL_ID = "model_id"  # the version's logged model (MLflow's SQL store keeps no link back)
VAL_ACCURACY, TEST_ACCURACY = "val_accuracy", "test_accuracy"
VAL_ROWS = "val_rows"  # SiloData.validation_digest of the rows val_accuracy was measured on
# How the silo joined: with the federation that trained (founder), or later (onboard).
JOINED, FOUNDER, ONBOARD = "joined", "founder", "onboard"
# A parent run's kind: a federation's training, or a silo's onboarding onto a trained one.
RUN_KIND, FEDERATION_RUN, ONBOARD_RUN = "run_kind", "federation", "onboard"
# Results per search call (MLflow's largest page of registered models); every page is read.
PAGE_SIZE = 1000


def pages(search: Callable[..., Any], filter_string: str | None = None) -> Iterator[Any]:
    """Every result of an MLflow search (search_registered_models, search_model_versions,
    search_logged_models with its experiments bound), following its page tokens."""
    token = None
    while True:
        page = search(filter_string, max_results=PAGE_SIZE, page_token=token)
        yield from page
        token = page.token
        if not token:
            return


def model_name(federation: str, silo: str) -> str:
    """The registered name of a silo's personalized model."""
    return f"{federation}-{silo}"


def foreign_owner(tags: Mapping[str, str], federation: str, silo: str) -> str | None:
    """Whose a registered model is, by its tags, when not silo `silo` of `federation`."""
    owner = (tags.get(FEDERATION), tags.get(SILO))
    if owner == (federation, silo):
        return None
    if None in owner:
        return "no silo of any federation (it has no federation and silo tags)"
    return f"federation {owner[0]}, silo {owner[1]}"


def collision(name: str, owner: str, federation: str, silo: str, where: str) -> str:
    """The one line saying that silo `silo`'s registered name `name` is taken by `owner`."""
    return (
        f"name: silo {silo} of federation {federation} registers its model as {name} in "
        f"{where}, but that registered model belongs to {owner}; rename the federation (name) "
        "or the silo so that <federation>-<silo> names no other silo's model"
    )


def check_owner(client: MlflowClient, federation: str, silos: Iterable[str], where: str) -> None:
    """Before round 1: each silo's registered name, if it exists in this store, is that silo's
    (its tags name this federation and silo); otherwise a one-line ConfigError."""
    names = {model_name(federation, silo): silo for silo in silos}
    if not names:
        return
    # One search for every name: they all start with "<federation>-".
    for model in pages(client.search_registered_models, f"name LIKE '{federation}-%'"):
        silo = names.get(model.name)
        owner = None if silo is None else foreign_owner(model.tags, federation, silo)
        if owner is not None:
            raise ConfigError(collision(model.name, owner, federation, str(silo), where))


def tag_value(tags: dict[str, str], key: str) -> float:
    """A float tag (e.g. val_accuracy), NaN when absent or not a number."""
    try:
        return float(tags.get(key, "nan"))
    except ValueError:
        return math.nan


def promote(client: MlflowClient, name: str, version: str) -> bool:
    """Point `champion` at the best version scored on `version`'s validation rows (see the
    module docstring); True when that is `version`."""
    return crown(client, name, version) == str(version)


def crown(client: MlflowClient, name: str, version: str) -> str:
    """As `promote`, returning the version that holds `champion` now.

    Among versions of equal accuracy on those rows the earliest wins, and a champion on those
    rows keeps the alias against an equal one. A version without a `val_rows` tag (registered
    before scores carried one) or without a validation accuracy is never compared: with no
    version to compare, the newest takes the alias.
    """
    from mlflow.exceptions import MlflowException

    try:
        current = client.get_model_version_by_alias(name, CHAMPION)
    except MlflowException:
        current = None
    versions = list(pages(client.search_model_versions, f"name = '{name}'"))
    rows = next((v.tags.get(VAL_ROWS) for v in versions if str(v.version) == str(version)), None)

    def score(v: Any) -> tuple[float, int]:
        return tag_value(v.tags, VAL_ACCURACY), -int(v.version)

    peers = [
        v for v in versions if rows and v.tags.get(VAL_ROWS) == rows and not math.isnan(score(v)[0])
    ]
    chosen = str(version)
    if peers:
        best = max(peers, key=score)
        chosen = str(best.version)
        if current is not None and str(current.version) in {str(v.version) for v in peers}:
            chosen = str(current.version) if score(current)[0] >= score(best)[0] else chosen
    if current is None or str(current.version) != chosen:
        client.set_registered_model_alias(name, CHAMPION, chosen)
    return chosen


def version_tags(
    federation: str,
    silo: str,
    algorithm: str,
    run_id: str,
    round_: int,
    val: float,
    test: float,
    val_rows: str,
    joined: str = FOUNDER,
) -> dict[str, str]:
    """The tags of a registered version; accuracies as exact float reprs, and the digest of the
    validation rows `val` was measured on."""
    return {
        FEDERATION: federation,
        SILO: silo,
        ALGORITHM: algorithm,
        RUN_ID: run_id,
        ROUND: str(round_),
        VAL_ACCURACY: repr(float(val)),
        TEST_ACCURACY: repr(float(test)),
        VAL_ROWS: val_rows,
        JOINED: joined,
    }


def register(
    client: MlflowClient, name: str, model_id: str, location: str, tags: dict[str, str]
) -> str:
    """A new version of registered model `name` (created on first use); returns its number.
    A model of that name whose tags name another federation or silo is refused, not joined.

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
        owner = foreign_owner(client.get_registered_model(name).tags, federation, silo)
        if owner is not None:  # another federation's, made since the check before round 1
            raise FederationError(collision(name, owner, federation, silo, "the store")) from None
    version = client.create_model_version(
        name,
        source=location,
        run_id=tags[RUN_ID],
        tags={**tags, MODEL_ID: model_id},
        model_id=model_id,
    )
    link = [{"name": name, "version": version.version}]
    client.set_logged_model_tags(model_id, {MLFLOW_MODEL_VERSIONS: json.dumps(link)})
    return str(version.version)


def registered(
    client: MlflowClient, name: str, run_ids: Collection[str], round_: int | str
) -> Any | None:
    """The first version of `name` registered from one of `run_ids`' models of round `round_`
    (by its tags), if any: a resumed run's export finds the version its first attempt
    registered. One listing of the versions, however many runs."""
    versions = pages(client.search_model_versions, f"name = '{name}'")
    found = [
        v for v in versions if v.tags.get(RUN_ID) in run_ids and v.tags.get(ROUND) == str(round_)
    ]
    return min(found, key=lambda v: int(v.version)) if found else None


def receipt(name: str, version: str, model_id: str, champion: bool) -> dict[str, str]:
    """What a registration hands back: the version's URI, its logged model, whether champion."""
    return {
        "model_uri": f"models:/{name}/{version}",
        "registered_model": name,
        "version": str(version),
        "model_id": model_id,
        "champion": str(champion).lower(),
    }


def reuse(client: MlflowClient, name: str, version: Any) -> dict[str, str]:
    """The receipt of a version registered before (`registered`), as its registration gave it.

    `champion` is settled again, by `promote`'s rule on the newest version's rows: the first
    attempt may have stopped between registering the version and promoting it.
    """
    versions = pages(client.search_model_versions, f"name = '{name}'")
    newest = max(int(v.version) for v in versions)
    champion = crown(client, name, str(newest)) == str(version.version)
    return receipt(name, str(version.version), version.tags.get(MODEL_ID, ""), champion)


def publish(
    client: MlflowClient, name: str, model_id: str, location: str, tags: dict[str, str]
) -> dict[str, str]:
    """The one registration path, for the tracker and for a silo's own store alike.

    A logged model whose files are written becomes READY and an output of its run at its round,
    then a new version of `name`, then champion by `promote`'s rule. Idempotent per run and
    round: when a version of `name` from this run and round exists (a resumed run's export of
    the model its first attempt registered), that version's receipt is returned, and the new
    logged model, a copy of its files, is deleted.
    """
    from mlflow.entities import LoggedModelOutput, LoggedModelStatus

    done = registered(client, name, {tags[RUN_ID]}, tags[ROUND])
    if done is not None:
        client.delete_logged_model(model_id)
        return reuse(client, name, done)
    client.finalize_logged_model(model_id, LoggedModelStatus.READY)
    step = int(tags[ROUND])
    client.log_outputs(tags[RUN_ID], [LoggedModelOutput(model_id, step=step)])
    version = register(client, name, model_id, location, tags)
    return receipt(name, version, model_id, promote(client, name, version))
