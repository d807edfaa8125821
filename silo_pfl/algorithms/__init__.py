"""The algorithm registry: a name maps to a class and its parameter dataclass."""

from __future__ import annotations

import dataclasses
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from silo_pfl.algorithms.base import Algorithm, NoParams, Phase
from silo_pfl.config import TrainConfig
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
            f"algorithm.name: got {name!r}, expected one of {', '.join(sorted(ALGORITHMS))}"
        )
    return ALGORITHMS[str(name)]


def algorithm_config(raw: Any) -> dict[str, Any]:
    """Validate `algorithm` against the named algorithm's Params; return it with defaults filled."""
    data = OmegaConf.to_container(raw) if OmegaConf.is_config(raw) else dict(raw or {})
    cls = _lookup(data.pop("name", "fedavg"))
    try:
        params = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cls.Params), data))
    except OmegaConfBaseException as exc:
        key = f"algorithm.{exc.full_key}" if getattr(exc, "full_key", "") else "algorithm"
        allowed = ", ".join(f.name for f in dataclasses.fields(cls.Params)) or "only name"
        reason = str(exc).splitlines()[0]
        if "not in" in reason:
            reason = f"unknown key for {cls.name}; allowed: {allowed}"
        raise ConfigError(f"{key}: {reason}") from None
    check = getattr(params, "validate", None)
    if check is not None:
        check()
    return {"name": cls.name, **dataclasses.asdict(params)}


def build_algorithm(config: dict[str, Any], train: TrainConfig) -> Algorithm:
    """Instantiate the configured algorithm from a validated `algorithm` mapping."""
    data = dict(config)
    cls = _lookup(data.pop("name"))
    return cls(cls.Params(**data), train)


from silo_pfl.algorithms import fedavg, fedbn, fedper, fedrep, local  # noqa: E402, F401
