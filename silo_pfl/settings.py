"""Loading a job: the structure of `silo_pfl.config`, typed and checked against the registries.

`data.*` becomes the data source's own dataclass and every `algorithm.<name>` section that
algorithm's Params; plugins are imported first, so that algorithms they register are found. Every
error is a one-line ConfigError naming the key, raised before anything starts.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import math
import os
from pathlib import Path
from typing import Any

import torch

from silo_pfl.algorithms import Algorithm, algorithm_config, build_algorithm
from silo_pfl.config import (
    FederationConfig,
    ModelConfig,
    SiloConfig,
    check_name,
    check_node_label,
    describe_labels,
    merge_config,
    ray_address,
    read_yaml,
    silo_selector,
    to_dict,
    written_keys,
)
from silo_pfl.config_views import HIDDEN
from silo_pfl.data import (
    all_silo_names,
    check_partition,
    data_config,
    known_input_shape,
    silo_names,
)
from silo_pfl.errors import ConfigError, scrub, typed_line
from silo_pfl.models import build_model, check_adapters, check_hidden
from silo_pfl.node_env import names_variables
from silo_pfl.server_optimizers import resolve_server_optimizer
from silo_pfl.split import compute_split, parse_rules
from silo_pfl.training import has_batchnorm
from silo_pfl.unused_settings import unused

log = logging.getLogger("silo_pfl.settings")

# Input shapes that build each model only to read its state_dict keys (they do not depend on it:
# the transformer's keys are the same for images and feature vectors, only their shapes differ).
_PROBE_SHAPES = {
    "cnn_small": (1, 8, 8),
    "cnn_small_bn": (1, 8, 8),
    "resnet18": (3, 32, 32),
    "transformer": (1, 8, 8),
}


def build_config(
    base: Any = None, overrides: list[str] | None = None, probe: bool = True
) -> FederationConfig:
    """Merge a mapping (or DictConfig) with `key=value` overrides; type and validate it all.
    `probe` also builds the model once to check the split rules against its keys."""
    cfg = merge_config(base, overrides)
    _import_plugins(cfg.plugins)
    cfg.data = data_config(cfg.data)
    _check_selection_rows(cfg)
    cfg.algorithm = algorithm_config(cfg.algorithm)
    _check_finite(cfg.algorithm)
    _check_model(cfg)
    if cfg.split.local is not None:
        parse_rules(cfg.split.local)
    algorithm = build_algorithm(cfg.algorithm, cfg.train)
    algorithm.check_config(cfg)
    resolve_server_optimizer(cfg.server, algorithm.server_optimizer, cfg.algorithm["name"])
    if probe:
        _check_split(cfg, algorithm)
        check_partition(cfg.data, cfg.seed)
    _check_silos(cfg)
    setattr(cfg, CHECKED, _fingerprint(cfg))
    return cfg


CHECKED = "_silo_pfl_checked"  # a checked config's fingerprint, as build_config left it


def _fingerprint(cfg: FederationConfig) -> str:
    return json.dumps(to_dict(cfg), sort_keys=True, default=str)


def is_checked(cfg: FederationConfig) -> bool:
    """Whether `cfg` is as build_config checked it, unchanged since (a field set afterwards, such
    as cfg.rounds = 0, makes it unchecked)."""
    return getattr(cfg, CHECKED, None) == _fingerprint(cfg)


def load_config(path: str | Path, overrides: list[str] | None = None) -> FederationConfig:
    """Load a job YAML, apply `key=value` overrides, and validate everything before any work."""
    return user_config(read_yaml(Path(path)), overrides)


def user_config(base: Any, overrides: list[str] | None = None) -> FederationConfig:
    """build_config on a user's own job (a mapping, or a loaded config that overrides change),
    which also warns of each setting it gives that its other settings make do nothing
    (silo_pfl.unused_settings; of a loaded config, only the overrides are the user's)."""
    cfg = build_config(to_dict(base) if isinstance(base, FederationConfig) else base, overrides)
    written = written_keys(base, overrides, nulls=False)
    overridden = written_keys(None, overrides, nulls=False)
    for line in unused(cfg, split_rules(cfg), written, overridden):
        log.warning("%s", line)
    return cfg


def from_dict(data: dict[str, Any]) -> FederationConfig:
    """Rebuild a config the driver validated from `config.to_dict` output (inside actors)."""
    return build_config(data, probe=False)


def split_rules(cfg: FederationConfig) -> list[str]:
    """The split rules in force: the job's, or the algorithm's default."""
    if cfg.split.local is not None:
        return list(cfg.split.local)
    return list(build_algorithm(cfg.algorithm, cfg.train).local_rules())


def resolved_config(cfg: FederationConfig) -> dict[str, Any]:
    """Every key with the value in force: the defaults, the split rules (the algorithm's when the
    job names none), the threshold and quorum, and a section per silo. Run as a job, it gives the
    same run. metrics.enabled stays null where it is: on as the run joins a cluster, else off."""
    from silo_pfl.secure.topology import default_threshold

    resolved = to_dict(cfg)
    resolved["split"]["local"] = split_rules(cfg)
    silos = len(silo_names(cfg.data))
    if cfg.aggregation.secure and cfg.aggregation.secure_threshold is None:
        resolved["aggregation"]["secure_threshold"] = default_threshold(silos)
    if cfg.round.min_silos is None:  # every silo; under secure aggregation, its threshold
        threshold = resolved["aggregation"]["secure_threshold"]
        resolved["round"]["min_silos"] = threshold if cfg.aggregation.secure else silos
    default = dataclasses.asdict(SiloConfig())
    named = resolved["silos"]
    resolved["silos"] = {n: named.get(n, default) for n in all_silo_names(cfg.data)}
    if not cfg.tracking.enabled and cfg.tracking.uri == _default_uri():
        resolved["tracking"]["uri"] = None  # the load's default, not in force: written, it warns
    return resolved


def _default_uri() -> str | None:
    """The store a job that names none resolves to here; None where $MLFLOW_TRACKING_URI names
    one a run could not use (a job that writes its own is never refused for it)."""
    from silo_pfl.tracking.uri import resolve_uri

    try:
        return resolve_uri(None, "tracking.uri")
    except ConfigError:
        return None


def _check_split(cfg: FederationConfig, algorithm: Algorithm) -> None:
    """The split rules against the model's keys, and the algorithm's needs of the split; one that
    fails only because model.hidden=[] left the model its head alone names model.hidden."""
    try:
        _probe_split(cfg, algorithm, cfg.model.hidden)
    except ConfigError as exc:
        default = ModelConfig().hidden
        if cfg.model.hidden or not _split_holds(cfg, algorithm, default):
            raise
        reason = str(exc).split("; ")[0].removeprefix("split.local: ")
        raise ConfigError(
            f"model.hidden: got [], so model {cfg.model.name} has no hidden layer, only its head, "
            f"and {reason}; give it a hidden layer, e.g. model.hidden={default}"
        ) from None


def _split_holds(cfg: FederationConfig, algorithm: Algorithm, hidden: list[int]) -> bool:
    """Whether the split checks pass on the model built with `hidden`."""
    try:
        _probe_split(cfg, algorithm, hidden)
    except ConfigError:
        return False
    return True


def _probe_split(cfg: FederationConfig, algorithm: Algorithm, hidden: list[int]) -> None:
    """The split rules and the algorithm's needs checked on the model built with `hidden`."""
    shape = known_input_shape(cfg.data) or _PROBE_SHAPES.get(cfg.model.name, (1,))
    with torch.device("meta"):  # shapes and keys only: nothing is allocated, however large
        model = build_model(cfg.model.name, shape, 2, hidden, cfg.model.adapter_dim)
    parameters = sum(p.numel() for p in model.parameters())
    if parameters > MAX_PARAMETERS:
        raise ConfigError(
            f"model: {cfg.model.name} with model.hidden={list(hidden)} and model.adapter_dim="
            f"{cfg.model.adapter_dim} has {parameters:,} parameters, expected at most "
            f"{MAX_PARAMETERS:,} (1 GiB of float32 per copy; every silo holds several)"
        )
    if cfg.train.batch_size < 2 and has_batchnorm(model):
        raise ConfigError(
            f"train.batch_size: got {cfg.train.batch_size}, but model {cfg.model.name} has "
            "BatchNorm, which needs at least 2 rows in a batch (a batch of one is skipped, so "
            "nothing would train); expected train.batch_size >= 2"
        )
    try:
        split = compute_split(algorithm.prepare_model(model), split_rules(cfg))
    except ConfigError as exc:
        if cfg.split.local is not None:
            raise
        key = algorithm.rules_key
        change = "" if key == "algorithm.name" else f"change {key}, "
        raise ConfigError(
            f"{key}: {algorithm.name} keeps split.local={split_rules(cfg)} by default, "
            f"but on model {cfg.model.name}: {str(exc).split(': ', 1)[-1]}; {change}choose "
            "another model.name or set split.local"
        ) from None
    algorithm.check_split(split)


def _import_plugins(modules: list[str]) -> None:
    """Import each plugin module once; a failure names the entry and the module."""
    for index, module in enumerate(modules):
        try:
            importlib.import_module(module)
        except Exception as exc:
            raise ConfigError(
                f"plugins[{index}]: cannot import {module!r} ({typed_line(exc)}); expected an "
                "importable module name, e.g. my_team.algorithms"
            ) from None


def _check_selection_rows(cfg: FederationConfig) -> None:
    """A selection on validation accuracy needs validation rows: data.val_fraction=0 leaves none,
    and every round's would be NaN."""
    if cfg.eval.selection != "last" and getattr(cfg.data, "val_fraction", None) == 0:
        raise ConfigError(
            f"eval.selection: got {cfg.eval.selection!r}, which selects on validation rows, but "
            "data.val_fraction=0 leaves none; set data.val_fraction > 0 (e.g. 0.2) or "
            "eval.selection=last"
        )


def _check_finite(sections: dict[str, Any]) -> None:
    """Every number in an algorithm's options is finite (their own checks are bounds only)."""
    for name, params in sections.items():
        if not dataclasses.is_dataclass(params):
            continue
        for option in dataclasses.fields(params):
            value = getattr(params, option.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(
                    f"algorithm.{name}.{option.name}: got {value}, expected a finite number"
                )


# The widest hidden layer: two of them hold 268M parameters (1 GiB of float32) per copy of the
# model, and a silo holds several; a typo's extra digit would otherwise be allocated by every
# silo process. The whole model is held to the same (MAX_PARAMETERS, counted on the split's
# probe, built on torch's meta device), whatever its depth or adapters.
MAX_WIDTH = 16384
MAX_PARAMETERS = MAX_WIDTH * MAX_WIDTH


def _check_model(cfg: FederationConfig) -> None:
    """What the model's registry knows beyond its name (`config.check_ranges` checks that)."""
    check_adapters(cfg.model.name, cfg.model.adapter_dim)
    if cfg.model.adapter_dim > MAX_WIDTH:
        raise ConfigError(
            f"model.adapter_dim: got {cfg.model.adapter_dim}, expected 0 to {MAX_WIDTH}"
        )
    if any(isinstance(width, bool) or not isinstance(width, int) for width in cfg.model.hidden):
        raise ConfigError(f"model.hidden: got {list(cfg.model.hidden)}, expected a list of widths")
    if cfg.model.hidden and not 1 <= min(cfg.model.hidden) <= max(cfg.model.hidden) <= MAX_WIDTH:
        raise ConfigError(
            f"model.hidden: got {list(cfg.model.hidden)}, expected widths from 1 to {MAX_WIDTH}"
        )
    check_hidden(cfg.model.name, cfg.model.hidden)


def _check_nodes_apart(cfg: FederationConfig, names: list[str]) -> None:
    """Under ray.placement=per_node no two silos ask for the same node labels: the second would
    read the first one's data on that node and register a model of it under its own name."""
    if cfg.ray.placement != "per_node":
        return
    taken: dict[tuple[tuple[str, str], ...], str] = {}
    for silo in names:
        selector = silo_selector(cfg, silo) or {}
        labels = tuple(sorted(selector.items()))
        if labels in taken:
            named = silo if cfg.silos.get(silo) and cfg.silos[silo].node_label else taken[labels]
            other = taken[labels] if named == silo else silo
            raise ConfigError(
                f"silos.{named}.node_label: {describe_labels(dict(labels))} is also silo "
                f"{other}'s node; under "
                "ray.placement=per_node each silo needs a node of its own"
            )
        taken[labels] = silo


def check_node_variables(cfg: FederationConfig, on_cluster: bool) -> None:
    """On a cluster, a silo whose file or own store names $VARS, which each node fills in from
    its own environment, must be pinned to its node: Ray could run it on another institution's
    node, whose variable names that node's file. `on_cluster`: the run joins one (ray.address,
    RAY_ADDRESS; a submitted job's always does)."""
    if not on_cluster:
        return
    paths = getattr(cfg.data, "paths", None) or {}
    for silo in all_silo_names(cfg.data):
        own = cfg.silos.get(silo)
        named = {
            f"data.paths.{silo}": paths.get(silo),
            f"silos.{silo}.tracking_uri": own.tracking_uri if own is not None else None,
        }
        for key, value in named.items():
            if value is None or not names_variables(str(value)) or silo_selector(cfg, silo):
                continue
            raise ConfigError(
                f"{key}: {scrub(str(value))} names an environment variable, which each node "
                f"fills in from its own, but silo {silo} may run on any node of the cluster "
                "(ray.placement=any), where it would read that node's; pin it: "
                f"ray.placement=per_node, or silos.{silo}.node_label"
            )


def check_files_apart(cfg: FederationConfig, on_cluster: bool | None = None) -> None:
    """Two silos may not read one file: each would split the same rows its own way, so one
    silo's test rows would be another's training rows. On a cluster (`on_cluster`, by default
    whether the run joins one: ray.address, RAY_ADDRESS) one path names each node's own file,
    but only for silos pinned to nodes of their own (`silo_selector`): silos that may share a
    node (ray.placement=any, one node_label) may read one file there. A path with $VARS is
    `check_node_variables`'s. Called as a run, an onboarding or a submission starts, not at load:
    `silo-pfl submit` loads a cluster's job on a machine of its own."""
    if on_cluster is None:
        on_cluster = ray_address(cfg.ray.address) is not None
    paths = getattr(cfg.data, "paths", None) or {}
    seen: dict[str, list[str]] = {}
    for silo, path in paths.items():
        if names_variables(str(path)) or path == HIDDEN:  # HIDDEN: another silo's, in its view
            continue
        where = (
            os.path.normpath(str(path))
            if on_cluster
            else str(Path(os.path.expanduser(str(path))).resolve())
        )
        for other in seen.get(where, []):
            if not on_cluster:
                raise ConfigError(
                    f"data.paths.{silo}: names the file of silo {other} ({where}); each silo "
                    "reads a file of its own rows, or rows would be in two silos"
                )
            mine, theirs = silo_selector(cfg, str(silo)), silo_selector(cfg, other)
            if not _apart(mine, theirs):
                raise ConfigError(
                    f"data.paths.{silo}: names the path of silo {other} ({where}), which is each "
                    "node's own file only for silos on nodes of their own, and these two may "
                    "share one; pin each: ray.placement=per_node, or silos.<name>.node_label"
                )
        seen.setdefault(where, []).append(str(silo))


def _apart(mine: dict[str, str] | None, theirs: dict[str, str] | None) -> bool:
    """Whether no node can carry both label selectors: they give one label two values."""
    return bool(mine and theirs and any(theirs.get(k, v) != v for k, v in mine.items()))


def _check_secure(cfg: FederationConfig, names: list[str]) -> None:
    """Secure aggregation needs two silos, a majority threshold, a quorum no smaller, and either
    every silo's identity key or none."""
    from silo_pfl.secure.fixed_point import RESOLUTION, bound
    from silo_pfl.secure.identity import configured_keys
    from silo_pfl.secure.topology import default_threshold

    if len(names) < 2:
        raise ConfigError(
            "aggregation.secure: needs at least 2 silos, so that no single update can be unmasked"
        )
    threshold = cfg.aggregation.secure_threshold
    if threshold is not None and not len(names) // 2 < threshold <= len(names):
        raise ConfigError(
            f"aggregation.secure_threshold: got {threshold}, expected {len(names) // 2 + 1} to "
            f"{len(names)} (a majority of the {len(names)} silos, so that no silo's two secrets "
            "can both be recovered), or null for ceil(2N/3)"
        )
    threshold = threshold or default_threshold(len(names))
    clip, most = cfg.aggregation.clip, bound(len(names))
    if clip is not None and not clip < most:
        raise ConfigError(
            f"aggregation.clip: got {clip:g}, but a clipped value times its silo's rows must "
            f"stay below {most:.3g} for {len(names)} silos; expected a number below that"
        )
    if clip is not None and clip < RESOLUTION:
        raise ConfigError(
            f"aggregation.clip: got {clip:g}, below the fixed point's resolution "
            f"({RESOLUTION:.3g}): a silo of one row would send every clipped value as 0, and "
            "others a few steps of it at most; expected at least that"
        )
    quorum = cfg.round.min_silos
    if quorum is not None and quorum < threshold:
        raise ConfigError(
            f"round.min_silos: got {quorum}, but a secure round needs {threshold} silos "
            "(aggregation.secure_threshold); raise it or set it to null"
        )
    neighbors = cfg.aggregation.secure_graph.neighbors
    if neighbors is not None:
        _check_graph(neighbors, len(names), threshold)
    configured_keys(cfg, names)


def _check_graph(neighbors: int, silos: int, threshold: int) -> None:
    """Warn of a SecAgg+ graph that is not what its k says: a full mesh (k raised to an even
    degree, or k >= N - 1), or one whose secrets need every holder (or so many of them that fewer
    silos dropping than the threshold tolerates fail the round)."""
    from silo_pfl.secure.topology import degree, share_threshold

    key = f"aggregation.secure_graph.neighbors={neighbors}"
    peers = degree(silos, neighbors)
    if peers >= silos - 1:
        raised = ""
        if neighbors < silos - 1:
            raised = f" (raised to {peers}: {neighbors} and {silos} are both odd)"
        below = silos - 1 - silos % 2  # the least full mesh's degree; k is at least 2
        saves = f"only with fewer than {below}" if below > 2 else f"nothing with {silos} silos"
        log.warning(
            "%s%s: with %d silos each silo pairs with every other, a full mesh as with null; "
            "SecAgg+ saves %s",
            key,
            raised,
            silos,
            saves,
        )
        return
    if peers != neighbors:
        log.warning(
            "%s: no %d-regular graph of %d silos exists, so each silo pairs with %d",
            key,
            neighbors,
            silos,
            peers,
        )
    holders = peers + 1
    needed = share_threshold(holders, threshold, silos)
    tolerated = holders - needed
    if tolerated == 0:
        log.warning(
            "%s: each silo's secrets are shared among its %d holders (itself and its peers) and "
            "need all of them, so any silo that drops fails the round; a larger k tolerates "
            "dropouts",
            key,
            holders,
        )
    elif tolerated < silos - threshold:
        log.warning(
            "%s: each silo's secrets need %d of its %d holders (itself and its peers), so %d of "
            "one silo's peers lost after sharing keys fail the round, where "
            "aggregation.secure_threshold=%d tolerates %d lost; a larger k tolerates more",
            key,
            needed,
            holders,
            tolerated + 1,
            threshold,
            silos - threshold,
        )


def _check_silos(cfg: FederationConfig) -> None:
    """Every silo's name must be fit for paths (config.check_name); silos.<name> must name a silo
    of this federation; store URIs must be usable; secure aggregation's settings must fit its
    silos."""
    from silo_pfl.tracking.uri import check_uri, resolve_uri

    given = getattr(cfg.data, "paths", None) or {}
    for silo in all_silo_names(cfg.data):
        check_name(silo, "data.paths" if silo in given else "data.source", "silo name ")
    names = silo_names(cfg.data)
    quorum = cfg.round.min_silos
    if quorum is not None and not 1 <= quorum <= len(names):
        raise ConfigError(
            f"round.min_silos: got {quorum}, expected 1 to {len(names)} (the number of silos), "
            "or null for every silo"
        )
    if cfg.aggregation.secure:
        _check_secure(cfg, names)
    every = all_silo_names(cfg.data)
    for silo, settings in cfg.silos.items():
        if silo not in every:
            raise ConfigError(
                f"silos.{silo}: not a silo of this federation; its silos are {', '.join(every)}"
            )
        if settings.tracking_uri is not None:
            key, uri = f"silos.{silo}.tracking_uri", str(settings.tracking_uri).strip()
            # With $VARS it is checked on the silo's node, where they are set (uri.node_uri).
            settings.tracking_uri = uri if names_variables(uri) else check_uri(uri, key)
        check_node_label(settings.node_label, f"silos.{silo}.node_label")
    check_node_label(cfg.server.node_label, "server.node_label")
    _check_nodes_apart(cfg, every)
    check_node_variables(cfg, ray_address(cfg.ray.address) is not None)
    cfg.tracking.uri = resolve_uri(cfg.tracking.uri, "tracking.uri")
