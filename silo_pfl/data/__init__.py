"""Data sources, registered by name. A silo calls `load_silo_data` inside its own process."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from types import ModuleType

import numpy as np

from silo_pfl.config import DataConfig
from silo_pfl.data import csv_source, digits, heart_disease
from silo_pfl.data.base import Preprocessing, SiloData
from silo_pfl.errors import ConfigError

SOURCES: dict[str, ModuleType] = {
    "heart_disease": heart_disease,
    "digits": digits,
    "csv": csv_source,
}

__all__ = ["SOURCES", "Preprocessing", "SiloData", "load_silo_data", "raw_encoder", "silo_names"]


def _source(cfg: DataConfig) -> ModuleType:
    if cfg.source not in SOURCES:
        raise ConfigError(
            f"data.source: got {cfg.source!r}, expected one of {', '.join(sorted(SOURCES))}"
        )
    return SOURCES[cfg.source]


def validate_data_config(cfg: DataConfig) -> None:
    """Config-level checks, before any silo starts."""
    if not 0.0 <= cfg.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction: got {cfg.val_fraction}, expected 0 <= value < 1")
    if not 0.0 < cfg.test_fraction < 1.0:
        raise ConfigError(f"data.test_fraction: got {cfg.test_fraction}, expected 0 < value < 1")
    source = _source(cfg)
    _reject_unused_options(cfg, source.OPTIONS)
    source.validate(cfg)


def _reject_unused_options(cfg: DataConfig, used: tuple[str, ...]) -> None:
    """A data.* key set away from its default that this source never reads is an error."""
    defaults = DataConfig(source=cfg.source)
    for option in dataclasses.fields(DataConfig):
        name = option.name
        if name == "source" or name in used:
            continue
        if getattr(cfg, name) != getattr(defaults, name):
            raise ConfigError(
                f"data.{name}: not used by data.source={cfg.source}; its options: {', '.join(used)}"
            )


def silo_names(cfg: DataConfig) -> list[str]:
    """The silos of this federation, in a fixed order."""
    return list(_source(cfg).silo_names(cfg))


def load_silo_data(cfg: DataConfig, silo: str, seed: int) -> SiloData:
    """Load one silo's private data; deterministic for a given seed."""
    return _source(cfg).load(cfg, silo, seed)


def raw_encoder(source: str) -> Callable[[np.ndarray], np.ndarray]:
    """The source's map from raw rows (SiloData.raw_columns) to inputs before Preprocessing."""
    if source not in SOURCES:
        raise ConfigError(f"data.source: got {source!r}, expected one of {', '.join(SOURCES)}")
    return SOURCES[source].encode_raw
