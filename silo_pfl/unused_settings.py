"""Settings a job gives that its other settings make do nothing: a warning each, never an error.

Only keys the user wrote (the job's mapping and its overrides) are named, and only with a value
(not null) other than the key's default: a resolved config, such as an actor's copy, onboarding's
or `silo-pfl config`'s output run as a job, carries every key, and server.optimizer there is the
algorithm's default, not a choice.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterator
from fnmatch import fnmatchcase
from typing import Any

from silo_pfl.algorithms import ALGORITHMS
from silo_pfl.config import FederationConfig

# What a rule finds: its condition, the patterns of the keys it makes do nothing, and why ("{it}"
# stands for the keys found: it or them).
Finding = tuple[str, tuple[str, ...], str]
SERVER_STEP = ("server.optimizer", "server.lr", "server.beta1", "server.beta2", "server.tau")
SERVER_READERS = {  # each server optimizer's setting, and the optimizers that read it
    "server.beta1": ("momentum", "adam", "yogi", "adagrad"),
    "server.beta2": ("adam", "yogi"),
    "server.tau": ("adam", "yogi", "adagrad"),
}


def _rules(cfg: FederationConfig, local_rules: list[str]) -> Iterator[Finding]:
    """Every rule that applies to `cfg`, in the order their keys are named."""
    if not cfg.aggregation.secure:
        yield (
            "aggregation.secure is false",
            (
                "aggregation.secure_threshold",
                "aggregation.secure_graph.neighbors",
                "aggregation.identity_keys",
                "aggregation.clip",
                "silos.*.identity_key",
                "silos.*.key_dir",
            ),
            "the updates reach the server in the clear; set aggregation.secure=true to mask them",
        )
    if "all" in local_rules:
        yield (
            f"split.local={local_rules} keeps every key on its silo (algorithm "
            f"{cfg.algorithm['name']})",
            (
                *SERVER_STEP,
                "aggregation.max_update_norm",
                "aggregation.max_extra_norm",
            ),  # not aggregation.secure: it still masks each silo's weight, its row count
            "there is nothing to aggregate",
        )
    for key, readers in SERVER_READERS.items():
        if cfg.server.optimizer not in readers:
            yield (
                f"server.optimizer is {cfg.server.optimizer}",
                (key,),
                f"only {', '.join(readers[:-1])} and {readers[-1]} read {{it}}",
            )
    if cfg.train.optimizer != "sgd":
        yield (
            f"train.optimizer is {cfg.train.optimizer}",
            ("train.momentum",),
            "only sgd reads {it}",
        )
    if cfg.model.name not in ("mlp", "transformer"):
        yield (
            f"model.name is {cfg.model.name}",
            ("model.hidden",),
            "only mlp and transformer read {it}",
        )
    if cfg.ray.address is not None:
        yield (
            f"ray.address is {cfg.ray.address}",
            ("ray.num_cpus", "metrics.export_interval_s", "metrics.linger_s"),
            "only a local Ray reads {it}; a cluster keeps the CPUs and export interval its nodes "
            "were started with",
        )
    if cfg.ray.placement == "per_node":
        yield (
            "ray.placement is per_node",
            ("ray.silos_per_worker",),
            "each silo has a worker of its own, on its own node",
        )
    if cfg.metrics.enabled is False:
        yield (
            "metrics.enabled is false",
            ("metrics.export_interval_s", "metrics.linger_s"),
            "no live metrics are exported",
        )
    if not cfg.tracking.enabled:
        yield (
            "tracking.enabled is false",
            ("tracking.uri", "tracking.report", "privacy.central_models", "silos.*.tracking_uri"),
            "nothing is recorded in MLflow",
        )
    name = cfg.algorithm["name"]
    algorithm = ALGORITHMS[name]
    if cfg.split.local is not None and algorithm.rules_key != "algorithm.name":
        yield (
            f"split.local is {list(cfg.split.local)}",
            (algorithm.rules_key,),
            "split.local replaces the split {it} would make",
        )
    if not algorithm.Strategy.extras:
        yield (
            f"algorithm.name is {name}",
            ("aggregation.max_extra_norm",),
            "its updates carry nothing beside the delta (SCAFFOLD's carry their c change)",
        )
    own_rules = getattr(cfg.algorithm[name], "unused", None)  # the chosen algorithm's own
    for condition, keys, why in own_rules() if own_rules else ():
        section = f"algorithm.{name}"
        yield f"{section}.{condition}", tuple(f"{section}.{key}" for key in keys), why


def _ignored(cfg: FederationConfig) -> Iterator[Finding]:
    """The settings outside its section that the chosen algorithm never reads."""
    name = cfg.algorithm["name"]
    for key, why in ALGORITHMS[name].ignores.items():
        yield f"algorithm.name is {name}", (key,), why


def _other_algorithms(cfg: FederationConfig) -> Finding:
    """Another algorithm's options section."""
    name = cfg.algorithm["name"]
    others = sorted(set(cfg.algorithm) - {"name", name})
    patterns = tuple(f"algorithm.{other}.*" for other in others)
    return f"algorithm.name is {name}", patterns, f"only algorithm.{name}.* is read"


def unused(
    cfg: FederationConfig,
    local_rules: list[str],
    written: Collection[str],
    overridden: Collection[str],
) -> list[str]:
    """One line per condition naming the keys in `written` that it makes do nothing, each key
    once. Another algorithm's options are named only from `overridden` (the overrides' keys): a
    job's own sections may serve a switch of algorithm.name, and so may its settings that the
    algorithm switched to does not read (fedrep's train.local_epochs): those are named from
    `overridden` too, unless the job itself chose the algorithm."""
    findings = [(rule, written) for rule in _rules(cfg, local_rules)]
    switched = "algorithm.name" in overridden
    findings += [(rule, overridden if switched else written) for rule in _ignored(cfg)]
    findings.append((_other_algorithms(cfg), overridden))
    named: set[str] = set()
    lines = []
    for (condition, patterns, why), keys in findings:
        hits = [
            key
            for pattern in patterns
            for key in sorted(keys)
            if fnmatchcase(key, pattern) and key not in named and _chosen(cfg, key)
        ]
        if hits:
            named.update(hits)
            verb, it = ("has", "it") if len(hits) == 1 else ("have", "them")
            why = why.replace("{it}", it)
            lines.append(f"{condition}, so {', '.join(hits)} {verb} no effect: {why}")
    return lines


def _chosen(cfg: FederationConfig, key: str) -> bool:
    """Whether the dotted key holds a value (not null) other than its default: FederationConfig's,
    or else that of the options class its section is (an algorithm's Params)."""
    value = _value(cfg, key)
    default = _default(key)
    section, _, leaf = key.rpartition(".")
    options = _value(cfg, section)
    if default is NO_DEFAULT and dataclasses.is_dataclass(options):
        default = _default(leaf, type(options))
    return value is not None and value != default


def _default(key: str, root: type = FederationConfig) -> Any:
    """The dataclass default of a dotted key of `root`; a marker of no default where it has none
    (a required key, or one in a free-form section such as data.*, silos.* or algorithm.*)."""
    value: Any = root
    for part in key.split("."):
        sections = dataclasses.is_dataclass(value)
        fields = {f.name: f for f in dataclasses.fields(value)} if sections else {}
        field = fields.get(part)
        if field is None:
            return NO_DEFAULT
        if field.default is not dataclasses.MISSING:
            value = field.default
        elif field.default_factory is not dataclasses.MISSING:
            value = field.default_factory()
        else:
            return NO_DEFAULT
    return value


NO_DEFAULT = object()


def _value(cfg: FederationConfig, key: str) -> Any:
    """The value at a dotted key of the loaded config (None where there is none)."""
    value: Any = cfg
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else getattr(value, part, None)
    return value
