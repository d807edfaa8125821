"""Data sources, registered by name. A silo calls `load_silo_data` inside its own process."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

import numpy as np
from omegaconf import OmegaConf

from silo_pfl.config import DataConfig
from silo_pfl.config_errors import KeyedError, merge_structured
from silo_pfl.data import csv_source, digits, heart_disease
from silo_pfl.data.base import Preprocessing, SiloData, kept_train_rows
from silo_pfl.errors import ConfigError

SOURCES: dict[str, ModuleType] = {
    "heart_disease": heart_disease,
    "digits": digits,
    "csv": csv_source,
}

__all__ = [
    "SOURCES",
    "Preprocessing",
    "SiloData",
    "all_silo_names",
    "check_partition",
    "known_input_shape",
    "load_silo_data",
    "raw_encoder",
    "silo_names",
]


def _source(name: object) -> ModuleType:
    if not isinstance(name, str) or name not in SOURCES:
        raise ConfigError(
            f"data.source: got {name!r}, expected one of {', '.join(sorted(SOURCES))}"
        )
    return SOURCES[str(name)]


def data_config(raw: Any) -> DataConfig:
    """Type the data.* mapping as its source's dataclass (a DataConfig) and check it; an option
    the source does not have is an error naming it and listing the source's options."""
    if raw is not None and not OmegaConf.is_dict(raw) and not isinstance(raw, Mapping):
        raise ConfigError(
            f"data: got {raw!r}, expected a mapping, e.g. {{source: heart_disease, paths: ...}}"
        )
    values = OmegaConf.to_container(raw) if OmegaConf.is_config(raw) else dict(raw or {})
    if "source" not in values:
        raise ConfigError(f"data.source: required; expected one of {', '.join(sorted(SOURCES))}")
    source = _source(values["source"])
    options = ", ".join(f.name for f in dataclasses.fields(source.Params))
    try:
        cfg = OmegaConf.to_object(merge_structured(source.Params, values))
    except KeyedError as error:
        if error.reason.startswith("unknown key"):
            raise ConfigError(
                f"data.{error.key}: not an option of data.source={values['source']}; its "
                f"options: {options}"
            ) from None
        raise ConfigError(f"data.{error}") from None
    if not 0.0 <= cfg.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction: got {cfg.val_fraction}, expected 0 <= value < 1")
    test_fraction = getattr(cfg, "test_fraction", 0.5)
    if not 0.0 < test_fraction < 1.0:
        raise ConfigError(f"data.test_fraction: got {test_fraction}, expected 0 < value < 1")
    if cfg.max_train_rows is not None and cfg.max_train_rows < 1:
        raise ConfigError(
            f"data.max_train_rows: got {cfg.max_train_rows}, expected >= 1 or null for every row"
        )
    source.validate(cfg)
    _check_late_silos(cfg)
    return cfg  # type: ignore[no-any-return]


def _check_late_silos(cfg: DataConfig) -> None:
    names = all_silo_names(cfg)
    for silo in cfg.late_silos:
        if silo not in names:
            raise ConfigError(
                f"data.late_silos: {silo!r} is not a silo of data.source={cfg.source}; its silos "
                f"are {', '.join(names)}"
            )
    if len(set(cfg.late_silos)) != len(cfg.late_silos):
        raise ConfigError(f"data.late_silos: got {list(cfg.late_silos)}, a silo named twice")
    if not silo_names(cfg):
        raise ConfigError("data.late_silos: names every silo; leave at least one to train")


def known_input_shape(cfg: DataConfig) -> tuple[int, ...] | None:
    """The shape of the silos' inputs where the source knows it before any silo loads its data
    (a built-in dataset's); None where only the silos' files say (csv)."""
    shape = getattr(_source(cfg.source), "input_shape", None)
    return None if shape is None else tuple(shape(cfg))


def check_partition(cfg: DataConfig, seed: int) -> None:
    """The source's own check of the partition it makes from the seed alone, where it has one
    (digits': its Dirichlet draws), run once on the driver."""
    check = getattr(_source(cfg.source), "check_partition", None)
    if check is not None:
        check(cfg, seed)


def all_silo_names(cfg: DataConfig) -> list[str]:
    """Every silo the data source makes, late ones included, in a fixed order."""
    return list(_source(cfg.source).silo_names(cfg))


def silo_names(cfg: DataConfig) -> list[str]:
    """The silos this federation trains with: the source's, less data.late_silos."""
    return [name for name in all_silo_names(cfg) if name not in cfg.late_silos]


def load_silo_data(cfg: DataConfig, silo: str, seed: int) -> SiloData:
    """Load one silo's private data (a late silo's too); deterministic for a given seed.

    The built-in sources apply data.max_train_rows in `assemble`, before fitting preprocessing;
    for a source that does not, this keeps the same rows afterwards (its preprocessing fitted on
    every training row).
    """
    data = _source(cfg.source).load(cfg, silo, seed)
    keep = kept_train_rows(len(data.y_train), cfg.max_train_rows, seed, silo)
    if keep is None:
        return data
    return dataclasses.replace(
        data,
        x_train=data.x_train[keep],
        y_train=data.y_train[keep],
        num_train_total=len(keep) + len(data.y_val),
    )


def input_example(source: str, raw_columns: tuple[str, ...]) -> np.ndarray:
    """A served model's input example, made from the schema alone, never from a row: a source's
    own `example_row` (valid codes for categorical columns), else zeros (1, columns)."""
    made = getattr(SOURCES[source], "example_row", None)
    return made() if made is not None else np.zeros((1, len(raw_columns)))


def raw_encoder(source: str) -> Callable[[np.ndarray], np.ndarray]:
    """The source's map from raw rows (SiloData.raw_columns) to inputs before Preprocessing."""
    if source not in SOURCES:
        raise ConfigError(f"data.source: got {source!r}, expected one of {', '.join(SOURCES)}")
    return SOURCES[source].encode_raw
