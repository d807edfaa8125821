"""The listing behind `silo-pfl models`: every registered silo model, its aliases and scores."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from silo_pfl.errors import ConfigError
from silo_pfl.tracking.registry import (
    ALGORITHM,
    CHAMPION,
    FEDERATION,
    FOUNDER,
    JOINED,
    LATEST,
    ROUND,
    SILO,
    TEST_ACCURACY,
    VAL_ACCURACY,
    VAL_ROWS,
    pages,
    tag_value,
)

if TYPE_CHECKING:
    from mlflow import MlflowClient

ROWS_SHOWN = 8  # hex digits of a version's val_rows digest in the table: enough to tell them apart


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
    joined: str = FOUNDER  # founder, or onboard (joined the trained federation later)
    val_rows: str = ""  # the validation rows' digest: versions with the same one are ranked

    @property
    def serve_uri(self) -> str:
        """The URI to load or serve this version by: an alias when it has one."""
        alias = next((a for a in (CHAMPION, LATEST) if a in self.aliases), None)
        return f"models:/{self.name}@{alias}" if alias else f"models:/{self.name}/{self.version}"


def model_rows(
    client: MlflowClient, federation: str | None = None, every_version: bool = False
) -> list[ModelRow]:
    """Registered silo models (tagged by silo_pfl), newest version first within each model.

    Every page of the search is read. A version is attributed to the federation and silo its
    own tags name (those of its model when it has none), never by splitting the model's name:
    `<federation>-<silo>` is ambiguous when either holds '-'.
    """
    rows = []
    models = sorted(pages(client.search_registered_models), key=lambda m: m.name)
    for model in models:
        if model.tags.get(FEDERATION) is None or model.tags.get(SILO) is None:
            continue
        versions = pages(client.search_model_versions, f"name = '{model.name}'")
        versions = sorted(versions, key=lambda v: -int(v.version))
        newest = int(versions[0].version) if versions else 0
        # Versions found by search carry no aliases; the registered model maps alias -> version.
        named = client.get_registered_model(model.name).aliases
        for v in versions:
            fed = v.tags.get(FEDERATION, model.tags[FEDERATION])
            if federation is not None and fed != federation:
                continue
            number = int(v.version)
            aliases = tuple(sorted(a for a, n in named.items() if int(n) == number))
            aliases += (LATEST,) if number == newest else ()
            if not every_version and not aliases:
                continue
            silo = v.tags.get(SILO, model.tags[SILO])
            rows.append(_row(model.name, fed, silo, number, aliases, v.tags))
    return rows


def _row(
    name: str,
    federation: str,
    silo: str,
    version: int,
    aliases: tuple[str, ...],
    tags: dict[str, str],
) -> ModelRow:
    """One version's row, its figures from its tags."""
    return ModelRow(
        federation=federation,
        silo=silo,
        name=name,
        version=version,
        aliases=aliases,
        algorithm=tags.get(ALGORITHM, ""),
        val_accuracy=tag_value(tags, VAL_ACCURACY),
        test_accuracy=tag_value(tags, TEST_ACCURACY),
        joined=tags.get(JOINED, FOUNDER),
        val_rows=tags.get(VAL_ROWS, ""),
    )


def format_table(rows: list[ModelRow]) -> str:
    """A fixed-width table of model rows."""
    header = ("federation", "silo", "joined", "version", "aliases", "algorithm", "val acc")
    header += ("val rows", "test acc")
    lines = [(*header, "serve")]
    for r in rows:
        lines.append(
            (
                r.federation,
                r.silo,
                r.joined,
                str(r.version),
                ",".join(r.aliases) or "-",
                r.algorithm,
                f"{r.val_accuracy:.3f}",
                r.val_rows[:ROWS_SHOWN] or "-",
                f"{r.test_accuracy:.3f}",
                r.serve_uri,
            )
        )
    return _fixed_width(lines)


def _fixed_width(lines: list[tuple[str, ...]]) -> str:
    """Rows of cells as left-aligned columns two spaces apart."""
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip()
        for line in lines
    )


def local_models_table(directory: str, federation: str | None = None) -> str:
    """The `silo-pfl models --local DIR` output: the models kept in silos' own directories
    (privacy.central_models=global_only or none) under DIR, e.g. a node's output_dir."""
    import yaml

    from silo_pfl.errors import ConfigError
    from silo_pfl.tracking.exporter import LOCAL_MODEL_DIR

    root = Path(directory).expanduser()
    if not root.is_dir():
        raise ConfigError(f"--local {directory}: not a directory; expected a run's output_dir")
    lines = [("federation", "silo", "run", "round", "algorithm", "val acc", "test acc", "serve")]
    for spec in sorted(root.glob(f"**/silos/*/{LOCAL_MODEL_DIR}/MLmodel")):
        meta = (yaml.safe_load(spec.read_text()) or {}).get("metadata") or {}
        if FEDERATION not in meta or (federation is not None and meta[FEDERATION] != federation):
            continue
        lines.append(
            (
                str(meta[FEDERATION]),
                str(meta.get(SILO, "")),
                spec.parents[3].name,
                str(meta.get(ROUND, "")),
                str(meta.get(ALGORITHM, "")),
                f"{tag_value(meta, VAL_ACCURACY):.3f}",
                f"{tag_value(meta, TEST_ACCURACY):.3f}",
                f"mlflow models serve -m {spec.parent}",
            )
        )
    if len(lines) == 1:
        return f"no silo models kept locally under {root}"
    return _fixed_width(lines)


def models_table(uri: str | None, federation: str | None, every_version: bool) -> str:
    """The `silo-pfl models` output for the store at `uri` (default: as tracking.uri)."""
    from silo_pfl.tracking.store import open_existing
    from silo_pfl.tracking.uri import redact

    client, uri = open_existing(uri, "--tracking-uri")
    rows = model_rows(client, federation, every_version)
    if not rows and federation:
        raise ConfigError(
            f"--federation {federation}: no registered silo models of it in {redact(uri)}"
        )
    if not rows:
        return f"no registered silo models in {redact(uri)}"
    return format_table(rows)
