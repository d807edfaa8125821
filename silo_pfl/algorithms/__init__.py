"""The algorithm registry: a name maps to a class and its parameter dataclass."""

from __future__ import annotations

import dataclasses
from typing import Any

from omegaconf import OmegaConf

from silo_pfl.algorithms.base import Algorithm, NoParams, Phase
from silo_pfl.builtin_names import OWN_ALGORITHM
from silo_pfl.config import TrainConfig
from silo_pfl.config_errors import KeyedError, merge_structured
from silo_pfl.errors import ConfigError

ALGORITHMS: dict[str, type[Algorithm]] = {}

__all__ = ["ALGORITHMS", "Algorithm", "NoParams", "Phase", "algorithm_config", "build_algorithm"]


def register(cls: type[Algorithm]) -> type[Algorithm]:
    """Class decorator: make an algorithm available by its `name`."""
    if not cls.name or cls.name in ALGORITHMS:
        raise ValueError(f"algorithm name {cls.name!r} is empty or taken")
    ALGORITHMS[cls.name] = cls
    return cls


def _lookup(name: object) -> type[Algorithm]:
    if name not in ALGORITHMS:
        raise ConfigError(
            f"algorithm.name: got {name!r}, expected one of {', '.join(sorted(ALGORITHMS))}, "
            + OWN_ALGORITHM
        )
    return ALGORITHMS[str(name)]


def _params(name: str, values: Any) -> object:
    """Validate one algorithm's options section against its Params dataclass."""
    cls = ALGORITHMS[name]
    try:
        params = OmegaConf.to_object(merge_structured(cls.Params, values))
    except KeyedError as error:
        key = f"algorithm.{name}.{error.key}" if error.key else f"algorithm.{name}"
        allowed = ", ".join(f.name for f in dataclasses.fields(cls.Params)) or "none"
        reason = error.reason
        if reason.startswith("unknown key"):
            reason = f"unknown option of {name}; its options: {allowed}"
        raise ConfigError(f"{key}: {reason}") from None
    check = getattr(params, "validate", None)
    if check is not None:
        check()
    return params


def algorithm_config(raw: Any) -> dict[str, Any]:
    """Type and check `algorithm`: its `name`, and an options section per algorithm, e.g.

        algorithm: {name: fedper, fedper: {head_warmup_epochs: 1}, fedrep: {head_epochs: 10}}

    Every section is checked, so `algorithm.name=<other>` works on any job. The result keeps
    this shape, each section now that algorithm's Params; the chosen one's is always there.
    """
    data = OmegaConf.to_container(raw) if OmegaConf.is_config(raw) else dict(raw or {})
    name = str(data.pop("name", "fedavg"))
    _lookup(name)
    resolved: dict[str, Any] = {"name": name}
    for section, values in data.items():
        if section not in ALGORITHMS:
            raise ConfigError(
                f"algorithm.{section}: unknown key; expected name or an options section named "
                f"after an algorithm ({', '.join(sorted(ALGORITHMS))})"
            )
        if values is not None and not isinstance(values, dict):
            raise ConfigError(f"algorithm.{section}: expected a mapping of {section}'s options")
        resolved[section] = _params(section, values or {})
    resolved.setdefault(name, _params(name, {}))
    return resolved


def build_algorithm(config: dict[str, Any], train: TrainConfig) -> Algorithm:
    """Instantiate the configured algorithm from a validated `algorithm` mapping."""
    cls = _lookup(config["name"])
    params = config.get(cls.name)
    return cls(params if isinstance(params, cls.Params) else _params(cls.name, params or {}), train)


from silo_pfl.algorithms import (  # noqa: E402, F401
    apfl,
    ditto,
    fedavg,
    fedbn,
    fedopt,
    fedper,
    fedprox,
    fedrep,
    finetune,
    lg_fedavg,
    local,
    moe_heads,
    perfedavg,
    scaffold,
)
