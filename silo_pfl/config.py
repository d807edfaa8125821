"""The config's structure: dataclasses merged with YAML and `key=value` overrides, with the
checks that need nothing but the values (ranges, choices).

Sections whose shape depends on a registry (data.*, algorithm.<name>.*) are plain mappings here;
`silo_pfl.settings` types and checks them against the registries. This module imports neither.
Every error is a ConfigError whose one-line message names the key and says what is allowed.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from silo_pfl import builtin_names
from silo_pfl.config_errors import as_literal, merge_structured, omegaconf_error
from silo_pfl.errors import ConfigError, one_line
from silo_pfl.selection import MODES as SELECTION_MODES


@dataclass
class DataConfig:
    """What every data source reads; each source's own dataclass adds its options (data.*)."""

    source: str = MISSING  # a registered data source: heart_disease | digits | csv
    val_fraction: float = 0.2  # share of each silo's training rows held out for model selection
    # Silos the partition makes but the federation does not train with: they sit out, to join
    # later (`silo-pfl onboard`). They count within the source's silos (e.g. data.num_silos).
    late_silos: list[str] = field(default_factory=list)
    # Cap each silo's training rows (after the validation hold-out) at a seeded random subset of
    # this many, for the few-data case; None keeps them all.
    max_train_rows: int | None = None


@dataclass
class ModelConfig:
    """The network every silo trains; its modules are named body.* and head."""

    name: str = MISSING  # mlp | cnn_small | cnn_small_bn | resnet18 | transformer
    # mlp: hidden layer widths. transformer: [dim, depth, heads], the token width, the encoder
    # blocks (default 2) and the attention heads (default dim // 16, at least 1; dim must be a
    # multiple of it), so [32] is 2 blocks of width 32 with 2 heads. The other models ignore it.
    hidden: list[int] = field(default_factory=lambda: [32])
    # > 0: a residual bottleneck adapter this wide after each hidden layer of the body
    # (mlp, cnn_small, cnn_small_bn; the transformer: after each encoder block); the split rule
    # `adapters` keeps them local.
    adapter_dim: int = 0


@dataclass
class SplitConfig:
    """Which state_dict keys stay on the silo. None takes the algorithm's default rules."""

    # Rules: head | batchnorm | all | last:K | first:K | pattern:GLOB
    local: list[str] | None = None


@dataclass
class TrainConfig:
    """The local optimisation every silo runs each round."""

    local_epochs: int = 1  # epochs over the silo's training rows per round
    batch_size: int = 32
    optimizer: str = "sgd"  # sgd | adam
    lr: float = 0.01
    momentum: float = 0.0  # sgd only
    weight_decay: float = 0.0
    torch_threads: int = 1  # per silo process; silos run in parallel


@dataclass
class EvalConfig:
    """How each silo's personalized model is chosen and reported."""

    # one of silo_pfl.selection.MODES, each described there
    selection: str = "best_mean_val"
    # Evaluate the personalized models every this many rounds, and at the last; only those rounds
    # can be selected. The rounds between are committed (for resume) without a model to select.
    every: int = 1


# The most threads a silo's torch may use: torch starts about two per thread asked for, in
# every silo process, and a node's process ids run out long before a typo's 100000.
MAX_TORCH_THREADS = 256
MAX_TIMEOUT_S = 30 * 24 * 3600  # a round's deadlines are finite: Ray's waits take milliseconds


@dataclass
class RoundConfig:
    """How a round runs: its deadline, its quorum, and its retries."""

    # The deadline of each round's training and evaluation: a silo that misses it is left out
    # of that round.
    timeout_s: float = 600.0
    # The longest any other remote step (set-up with the actors' start, resume, outcome, export)
    # may take before the run fails naming the silo and the step.
    call_timeout_s: float = 600.0
    # The fewest silos whose updates a round must aggregate; None: every silo.
    min_silos: int | None = None
    # How often a round without a quorum is tried again before the run fails.
    retries: int = 2


@dataclass
class SecureGraphConfig:
    """SecAgg+ (Bell et al., 2020): each silo pairs with `neighbors` others, not all."""

    neighbors: int | None = None  # peers per silo on a Harary graph (topology.py); None: all


@dataclass
class AggregationConfig:
    """How the server combines the silos' updates."""

    # Secure aggregation (silo_pfl.secure): the server learns only the sum of the updates.
    secure: bool = False
    # Silos needed at every step of a secure round, and shares that recover a secret;
    # None: ceil(2N/3) of the N silos. Must be a majority.
    secure_threshold: int | None = None
    secure_graph: SecureGraphConfig = field(default_factory=SecureGraphConfig)
    # A file of every silo's public identity key, lines of "<silo> <base64>"; or list each one
    # as silos.<name>.identity_key. Neither: the driver relays the keys the silos report.
    identity_keys: str | None = None
    # Under secure: bound every value of an update to [-clip, clip] before encoding; None: a
    # value outside the fixed-point range is an error naming the silo.
    clip: float | None = None
    # Reject a silo's update whose L2 norm (over the global keys' float values: not integer
    # counters such as BatchNorm's step count) exceeds this; None: no bound.
    max_update_norm: float | None = None
    # The same for each extra an update carries beside its delta (SCAFFOLD's control-variate
    # change, which moves the server's c and so every silo's training): a bound of its own, as
    # its scale is a gradient's, not a delta's; None: no bound.
    max_extra_norm: float | None = None


@dataclass
class RayConfig:
    """Where the federation runs."""

    address: str | None = None  # None starts a local Ray; "auto" or host:port joins a cluster
    num_cpus: int | None = None  # local Ray only; None uses every core
    # any: wherever Ray likes, except where silos.<name>.node_label / server.node_label pin it |
    # per_node: silo X only on a node labelled silo=X (unless its own node_label says otherwise),
    # the server on the head node (unless server.node_label says otherwise)
    placement: str = "any"
    silo_cpus: float = 0.0  # CPUs reserved per silo; 0 lets many silos share a core
    # How many silos live in one worker process (each with its own model, state and RNG):
    # an integer k >= 1, or auto: 1 under placement=per_node (an actor per silo, on its own node),
    # else as few workers as the Ray instance has CPUs.
    silos_per_worker: Any = "auto"


@dataclass
class TrackingConfig:
    """MLflow: the run and its silos' metrics, and every silo's registered personalized model."""

    enabled: bool = True  # false: no MLflow at all, it is not even imported
    # Tracking and registry store. None: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db in the
    # working directory (artifacts in <db dir>/mlartifacts/<name>).
    uri: str | None = None
    # At the end of a run, the run report (report/report.html and its PNG figures) on the
    # parent run; false for a benchmark that times the run without it.
    report: bool = True


CENTRAL_MODELS = ("full", "global_only", "none")


@dataclass
class PrivacyConfig:
    """What reaches the central store (tracking.uri); see the README's privacy section."""

    # full: each silo's personalized model (its local layers and normalisation statistics
    # included) is registered there, unless silos.<name>.tracking_uri names the silo's own store;
    # global_only: only the global layers (the run's global_model artifact); each silo's model
    # goes to its own store, or stays in its directory on its node (silo-pfl models --local);
    # none: no model; the central run keeps params and metrics (per silo too).
    central_models: str = "full"
    # Each silo's training rows per class (partition.json, the report's partition figure), kept
    # only under central_models=full, and never under aggregation.secure.
    label_counts: bool = True


@dataclass
class MetricsConfig:
    """Live metrics (ray.util.metrics) through Ray's metrics endpoint, for Prometheus/Grafana."""

    # None: on when the run joins a cluster (ray.address or RAY_ADDRESS), off for a local run.
    # A local run with metrics on writes Prometheus' service-discovery file itself (Ray's
    # dashboard, which a local Ray never starts, would write it).
    enabled: bool | None = None
    # A local Ray only: how often its processes export their figures to the metrics agent
    # (RAY_metrics_report_interval_ms; Ray's floor is 1 s, its default 10 s). A cluster keeps the
    # interval its nodes were started with.
    export_interval_s: float = 1.0
    # A local Ray only: how long it stays up after the last figures reached its metrics agent, so
    # that Prometheus scrapes them before the endpoint goes away (dashboards/prometheus/
    # prometheus.yml scrapes every 5 s). The run's end (the report, MLflow) overlaps it.
    linger_s: float = 5.0


@dataclass
class SiloConfig:
    """Settings of one silo, under silos.<name>."""

    # This silo's personalized model goes only to this MLflow store, never to tracking.uri.
    tracking_uri: str | None = None
    # Ray node labels this silo's actor needs, e.g. {silo: cleveland}; only such a node hosts it.
    node_label: dict[str, str] | None = None
    # Where its Ed25519 identity lives on its node; None: ~/.silo_pfl/keys/<federation>/<silo>.
    key_dir: str | None = None
    # Its public identity key (base64), as `silo-pfl keys show` prints it on its node.
    identity_key: str | None = None


@dataclass
class ServerConfig:
    """The server actor, which holds the global layers."""

    # Ray node labels the server needs; None: the head node under ray.placement=per_node.
    node_label: dict[str, str] | None = None
    # The server's optimizer over each round's mean update (Reddi et al., 2021):
    # sgd | momentum | adam | yogi | adagrad. None: the algorithm's own (fedadam: adam), else sgd.
    optimizer: str | None = None
    # the server's step size; None: 1.0 for sgd (FedAvg) and momentum (FedAvgM), else 0.01
    lr: float | None = None
    beta1: float = 0.9  # momentum, adam, yogi, adagrad: momentum of the mean update
    beta2: float = 0.99  # adam, yogi: decay of the second moment
    tau: float = 1e-3  # adam, yogi, adagrad: adaptivity, added to the second moment's root


@dataclass
class FederationConfig:
    """One federation run."""

    name: str = MISSING  # names the experiment and the silos' state directory
    rounds: int = MISSING  # federated rounds
    seed: int = 0  # the one seed every random generator derives from
    output_dir: str = "runs"  # each run's state lives in <output_dir>/<name>/<run_id>/
    # The data.* mapping; once loaded, the source's own dataclass (a DataConfig).
    data: Any = field(default_factory=dict)
    model: ModelConfig = field(default_factory=ModelConfig)
    # algorithm.name and a section of options per algorithm; once loaded, each section is that
    # algorithm's own Params dataclass.
    algorithm: dict[str, Any] = field(default_factory=lambda: {"name": "fedavg"})
    split: SplitConfig = field(default_factory=SplitConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    round: RoundConfig = field(default_factory=RoundConfig)
    aggregation: AggregationConfig = field(default_factory=AggregationConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    silos: dict[str, SiloConfig] = field(default_factory=dict)  # silo name -> its settings
    # Python modules every process (driver, silos, server) imports before reading the rest of
    # the config: they may register algorithms of their own. On a cluster each node must be
    # able to import them (ship them with the job's working_dir or py_modules).
    plugins: list[str] = field(default_factory=list)


def _parse_overrides(overrides: list[str]) -> DictConfig:
    import yaml  # OmegaConf's own YAML library, which reads each value

    parsed = OmegaConf.create()
    for index, item in enumerate(overrides):
        if not isinstance(item, str):
            raise ConfigError(f"overrides[{index}]: got {item!r}, expected a 'key=value' string")
        key = item.split("=", 1)[0]
        if "=" not in item or not all(key.split(".")):
            raise ConfigError(f"override '{item}': expected key=value, e.g. rounds=5")
        if not item.split("=", 1)[1].strip():
            none = f", or {key}=null for none" if _may_be_null(key) else ""
            raise ConfigError(
                f"{key}: got an empty value ('{key}=', an unset shell variable?); give a "
                f"value{none}"
            )
        try:
            one = OmegaConf.from_dotlist([item])
            text = item.split("=", 1)[1].strip()
            if "${" not in text:  # an interpolation resolves later, against the whole config
                _check_read_as_written(key, text, OmegaConf.select(one, key))
            parsed.merge_with(one)
        except OmegaConfBaseException as exc:
            raise omegaconf_error(exc) from None
        except yaml.YAMLError:
            raise ConfigError(
                f"override '{item}': {key}: its value is not valid YAML (an unclosed [ or {{?); "
                "expected e.g. [32, 16] or a quoted string"
            ) from None
    return parsed


def _declared(key: str) -> Any:
    """The type FederationConfig declares for the dotted `key`; None where the dataclasses do
    not say (a section of free keys)."""
    kind: Any = FederationConfig
    parts = key.split(".")
    while parts:
        value = typing.get_args(kind)[1] if typing.get_origin(kind) is dict else None
        if dataclasses.is_dataclass(value):  # silos.<name>: the name, then a silo's settings
            kind = value
            parts.pop(0)
            continue
        if not dataclasses.is_dataclass(kind):
            return None
        kind = typing.get_type_hints(kind).get(parts.pop(0))
        if kind is None:
            return None
    return kind


def _may_be_null(key: str) -> bool:
    """Whether FederationConfig lets the dotted `key` be null: its type is Optional or Any. A
    key the dataclasses do not know (a data source's own, an algorithm's) is not said to: its
    source's checks may refuse null."""
    kind = _declared(key)
    return kind is Any or (kind is not None and type(None) in typing.get_args(kind))


def _takes_bool(key: str) -> bool:
    """Whether FederationConfig declares the dotted `key` a boolean (or an optional one)."""
    kind = _declared(key)
    return bool in (kind, *typing.get_args(kind))


def _check_read_as_written(key: str, text: str, value: Any) -> None:
    """An override's value as YAML 1.1 reads it must be what it says in decimal or in words:
    seed=010 is 8 (octal), 0x10 is 16, 1:30 is 90 (base 60), and yes, no, on and off are
    booleans (name=yes would be 'True'). Such a value is refused, with how to write it."""
    if isinstance(value, int) and not isinstance(value, bool) and _takes_bool(key):
        none = ", or null" if _may_be_null(key) else ""
        raise ConfigError(f"{key}: got {text}, expected true or false{none}")
    if isinstance(value, bool):
        if text.lower() not in ("true", "false"):
            raise ConfigError(
                f"{key}: got {text}, which YAML reads as {str(value).lower()}; write true or "
                f"false, or quote it ('{text}') for the text"
            )
    elif isinstance(value, int):
        digits = text.lstrip("+-").replace("_", "")
        if not digits.isdigit() or int(digits) != abs(value):
            raise ConfigError(
                f"{key}: got {text}, which YAML reads as {value}; write the number in decimal, "
                f"or quote it ('{text}') for the text"
            )


def flat(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested mapping as dotted keys to its leaves (an empty mapping or a list is a leaf)."""
    leaves: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            leaves.update(flat(value, f"{prefix}{key}."))
        else:
            leaves[f"{prefix}{key}"] = value
    return leaves


def written_keys(
    base: Any = None, overrides: list[str] | None = None, nulls: bool = True
) -> set[str]:
    """The dotted keys a job's mapping and its `key=value` overrides give values to (each leaf,
    a list being one), e.g. {"rounds", "model.hidden", "silos.a.tracking_uri"}; without `nulls`,
    not those written as null (a default the load may resolve, as tracking.uri)."""
    keys: set[str] = set()
    for part in (base, _parse_overrides(overrides or [])):
        if part is not None and not isinstance(part, FederationConfig):
            leaves = flat(OmegaConf.to_container(OmegaConf.create(as_literal(part))))
            keys |= {key for key, value in leaves.items() if nulls or value is not None}
    return keys


def read_yaml(path: Path) -> DictConfig:
    """The YAML mapping in `path`; every way it can fail is one line naming the file."""
    import yaml  # OmegaConf's own YAML library

    if path.is_dir():
        raise ConfigError(f"config file {path}: is a directory, expected a YAML file")
    if path.exists() and not path.is_file():
        raise ConfigError(
            f"config file {path}: not a regular file (a pipe or a device, which a run may read "
            "more than once); write the YAML to a file and give its path"
        )
    if not path.is_file():
        raise ConfigError(f"config file {path}: not found")

    def duplicate(exc: yaml.MarkedYAMLError) -> str | None:
        """'key <dotted key> appears twice (lines M and N)' for OmegaConf's duplicate-key error."""
        mark = exc.problem_mark
        if mark is None or not str(exc.problem).startswith("found duplicate key"):
            return None
        try:
            root = yaml.compose(text, Loader=yaml.SafeLoader)
        except yaml.YAMLError:
            return None
        todo: list[tuple[str, yaml.Node]] = [("", root)]
        while todo:
            prefix, node = todo.pop()
            if isinstance(node, yaml.SequenceNode):
                todo += [(f"{prefix}[{i}]", item) for i, item in enumerate(node.value)]
            if not isinstance(node, yaml.MappingNode):
                continue
            first: dict[str, int] = {}
            for key, value in node.value:
                name = f"{prefix}.{key.value}" if prefix else str(key.value)
                if key.start_mark.line == mark.line and key.value in first:
                    lines = f"lines {first[key.value] + 1} and {mark.line + 1}"
                    return f"key {name} appears twice ({lines}); each key may appear only once"
                first.setdefault(key.value, key.start_mark.line)
                todo.append((name, value))
        return None

    try:
        text = path.read_text(encoding="utf-8")
        # OmegaConf reads a scalar on top as a key (or fails naming its type): refused below.
        # Composed by the parser OmegaConf's loader is built on, so syntax errors read the same.
        top = yaml.compose(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        loaded = OmegaConf.load(path) if top is None or isinstance(top, yaml.MappingNode) else None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path}: is not a UTF-8 text file") from None
    except OSError as exc:
        raise ConfigError(f"config file {path}: cannot be read ({exc.strerror or exc})") from None
    except yaml.MarkedYAMLError as exc:
        where = exc.problem_mark or exc.context_mark
        at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
        context = exc.context or ""
        if context and exc.context_mark is not None:
            context += f" started on line {exc.context_mark.line + 1}"
        reason = f"{exc.problem}" + (f" ({context})" if context else "")
        raise ConfigError(
            f"config file {path}: " + (duplicate(exc) or f"not valid YAML{at}: {reason}")
        ) from None
    except Exception as exc:  # any other yaml.YAMLError
        raise ConfigError(f"config file {path}: not valid YAML ({one_line(exc)})") from None
    if not isinstance(loaded, DictConfig):
        raise ConfigError(f"config file {path}: expected a mapping of keys at the top level")
    surprise = _yaml_surprise(top) if top is not None else None
    if surprise is not None:
        raise ConfigError(f"config file {path}: {surprise}")
    return loaded


_BOOL = "tag:yaml.org,2002:bool"
_INT = "tag:yaml.org,2002:int"
_STR = "tag:yaml.org,2002:str"
_NOT_DECIMAL = re.compile(r"[-+]?0[0-9_]+|[-+]?0[xXoObB].*")


def _yaml_surprise(root: Any) -> str | None:
    """What YAML 1.1 reads otherwise than written, unquoted: a key that is not a string (`no:`,
    a silo of Norway, becomes the boolean False), a name that becomes one (`name: no`), an
    integer not in decimal (`seed: 010` is octal 8), a number for a yes or no (`secure: 1`); and
    a dotted key on top (`train.lr: 0.3`), which only overrides may use. None if there is none."""
    todo: list[tuple[str, Any]] = [("", root)]
    while todo:
        prefix, node = todo.pop()
        if not hasattr(node, "value") or not isinstance(node.value, list):
            continue
        if not all(isinstance(item, tuple) for item in node.value):  # a sequence
            todo += [(f"{prefix}[{i}]", item) for i, item in enumerate(node.value)]
            continue
        for key, value in node.value:
            name = f"{prefix}.{key.value}" if prefix else str(key.value)
            if key.tag != _STR and not key.style and isinstance(key.value, str):
                return (
                    f"key {name!r} reads as a {key.tag.rsplit(':', 1)[-1]} in YAML, not as the "
                    f'name it spells; quote it: "{key.value}"'
                )
            if not prefix and isinstance(key.value, str) and "." in key.value:
                section, rest = key.value.split(".", 1)
                return (
                    f"key {name!r} holds a dot; in a file write it nested ({section}: {{{rest}: "
                    "...}); dotted keys are for key=value overrides"
                )
            plain = isinstance(value.value, str) and not value.style
            if plain and value.tag == _BOOL and name.rsplit(".", 1)[-1] == "name":
                return (
                    f"{name}: {value.value} reads as a boolean in YAML; quote it: "
                    f'{name.rsplit(".", 1)[-1]}: "{value.value}"'
                )
            if plain and value.tag == _INT and _takes_bool(name):
                none = ", or null" if _may_be_null(name) else ""
                return f"{name}: got {value.value}, expected true or false{none}"
            if plain and value.tag == _INT and _NOT_DECIMAL.fullmatch(value.value):
                import yaml

                read = yaml.safe_load(value.value)
                return (
                    f"{name}: {value.value} reads as {read} in YAML (not decimal); write the "
                    "number in decimal"
                )
            todo.append((name, value))
    return None


# The longest metrics.linger_s and metrics.export_interval_s: a scrape interval of Prometheus is
# seconds to minutes, and a longer wait would hold a finished run's end for nothing.
MAX_METRICS_SECONDS = 600.0


def _require(condition: bool, key: str, allowed: str, value: Any) -> None:
    if not condition:
        raise ConfigError(f"{key}: got {value!r}, expected {allowed}")


# What a name that becomes a path component, an MLflow name and a Ray label value may be.
NAME_RULE = (
    "1 to 63 letters, digits, '_', '-' or '.', starting and ending with a letter or digit, "
    "without '..', e.g. heart_disease"
)


def check_name(value: object, key: str, what: str = "") -> None:
    """A federation's or a silo's name: a directory (<output_dir>/<name>, silos/<silo>), part of
    MLflow names (`<federation>-<silo>`) and a Ray label value (silo=<silo>); `what` describes
    the value in the error, e.g. "silo name "."""
    text = str(value)
    if not _LABEL_NAME.fullmatch(text) or ".." in text:
        raise ConfigError(f"{key}: got {what}{text!r}, expected {NAME_RULE}")


def _check_not_blank(cfg: FederationConfig) -> None:
    """An empty string where null means "the default" (an unset shell variable's value, quoted)
    would silently pick that default: a store in the working directory, a local Ray instead of
    the cluster, another key directory, identity keys relayed by the driver rather than listed.
    Nor is output_dir, which has a default but no empty meaning, ever blank."""
    optional = [
        ("tracking.uri", cfg.tracking.uri),
        ("ray.address", cfg.ray.address),
        ("aggregation.identity_keys", cfg.aggregation.identity_keys),
    ]
    for silo, section in cfg.silos.items():
        optional.append((f"silos.{silo}.key_dir", getattr(section, "key_dir", None)))
        optional.append((f"silos.{silo}.identity_key", getattr(section, "identity_key", None)))
    for key, value in optional:
        if isinstance(value, str) and not value.strip():
            raise ConfigError(f"{key}: got {value!r}, expected a value, or null for the default")
    if not str(cfg.output_dir).strip():
        raise ConfigError(f"output_dir: got {cfg.output_dir!r}, expected a directory")


def check_ranges(cfg: FederationConfig) -> None:
    models = builtin_names.MODELS
    _require(cfg.model.name in models, "model.name", "one of " + ", ".join(models), cfg.model.name)
    name = cfg.algorithm.get("name", "fedavg")
    if not cfg.plugins:  # a plugin may register more; the registry checks those, on load
        algorithms = builtin_names.ALGORITHMS
        allowed = f"one of {', '.join(algorithms)}, {builtin_names.OWN_ALGORITHM}"
        _require(name in algorithms, "algorithm.name", allowed, name)
    _check_not_blank(cfg)
    t = cfg.train
    _require(cfg.rounds >= 1, "rounds", "an integer >= 1", cfg.rounds)
    _require(t.local_epochs >= 0, "train.local_epochs", "an integer >= 0", t.local_epochs)
    _require(t.batch_size >= 1, "train.batch_size", "an integer >= 1", t.batch_size)
    _require(0 < t.lr < math.inf, "train.lr", "a number > 0", t.lr)
    _require(0 <= t.momentum < 1, "train.momentum", "0 <= value < 1", t.momentum)
    _require(0 <= t.weight_decay < math.inf, "train.weight_decay", "a number >= 0", t.weight_decay)
    _require(t.optimizer in ("sgd", "adam"), "train.optimizer", "one of sgd, adam", t.optimizer)
    _require(
        1 <= t.torch_threads <= MAX_TORCH_THREADS,
        "train.torch_threads",
        f"an integer from 1 to {MAX_TORCH_THREADS}",
        t.torch_threads,
    )
    _require(
        cfg.eval.selection in SELECTION_MODES,
        "eval.selection",
        "one of " + ", ".join(SELECTION_MODES),
        cfg.eval.selection,
    )
    _require(cfg.eval.every >= 1, "eval.every", "an integer >= 1", cfg.eval.every)
    check_name(cfg.name, "name")
    _require(
        cfg.ray.placement in ("any", "per_node"),
        "ray.placement",
        "one of any, per_node",
        cfg.ray.placement,
    )
    for key in ("timeout_s", "call_timeout_s"):
        seconds = getattr(cfg.round, key)
        _require(
            0 < seconds <= MAX_TIMEOUT_S,
            f"round.{key}",
            f"a number of seconds > 0 and <= {MAX_TIMEOUT_S} (30 days)",
            seconds,
        )
    _require(cfg.round.retries >= 0, "round.retries", "an integer >= 0", cfg.round.retries)
    for name in ("max_update_norm", "max_extra_norm"):
        bound, key = getattr(cfg.aggregation, name), f"aggregation.{name}"
        if bound is not None:
            _require(bound > 0, key, "a number > 0, or null", bound)
            if cfg.aggregation.secure:
                raise ConfigError(
                    f"{key}: cannot be checked under aggregation.secure, where the server sees "
                    "only masked updates; set it to null or turn secure off"
                )
    _require(
        cfg.privacy.central_models in CENTRAL_MODELS,
        "privacy.central_models",
        f"one of {', '.join(CENTRAL_MODELS)}",
        cfg.privacy.central_models,
    )
    clip = cfg.aggregation.clip
    if clip is not None:
        _require(clip > 0, "aggregation.clip", "a number > 0, or null", clip)
    neighbors = cfg.aggregation.secure_graph.neighbors
    if neighbors is not None:
        _require(
            neighbors >= 2,
            "aggregation.secure_graph.neighbors",
            "an integer >= 2, or null",
            neighbors,
        )
    server = cfg.server
    if server.lr is not None:
        _require(0 < server.lr < math.inf, "server.lr", "a number > 0, or null", server.lr)
    _require(0 <= server.beta1 < 1, "server.beta1", "0 <= value < 1", server.beta1)
    _require(0 <= server.beta2 < 1, "server.beta2", "0 <= value < 1", server.beta2)
    _require(0 < server.tau < math.inf, "server.tau", "a number > 0", server.tau)
    cpus = cfg.ray.silo_cpus
    _require(  # Ray refuses a quantity below 0.0001 when it places an actor
        cpus == 0 or 1e-4 <= cpus < math.inf,
        "ray.silo_cpus",
        "0, or a finite number of CPUs from 0.0001",
        cpus,
    )
    per_worker = cfg.ray.silos_per_worker
    _require(
        per_worker == "auto"
        or (isinstance(per_worker, int) and not isinstance(per_worker, bool) and per_worker >= 1),
        "ray.silos_per_worker",
        "an integer >= 1, or auto",
        per_worker,
    )
    linger, interval = cfg.metrics.linger_s, cfg.metrics.export_interval_s
    _require(
        0 <= linger <= MAX_METRICS_SECONDS,
        "metrics.linger_s",
        f"a number of seconds from 0 to {MAX_METRICS_SECONDS:g}",
        linger,
    )
    _require(
        1 <= interval <= MAX_METRICS_SECONDS,
        "metrics.export_interval_s",
        f"a number of seconds from 1 to {MAX_METRICS_SECONDS:g}",
        interval,
    )
    if cfg.ray.num_cpus is not None:
        _require(cfg.ray.num_cpus >= 1, "ray.num_cpus", "an integer >= 1", cfg.ray.num_cpus)


# Ray node labels follow Kubernetes' syntax: an optional DNS-subdomain prefix and a name.
_LABEL_NAME = re.compile(r"^[a-zA-Z0-9]([a-zA-Z0-9_.-]{0,61}[a-zA-Z0-9])?$")
_LABEL_PREFIX = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


SILO_LABEL = "silo"  # per_node: silo X runs on the node labelled silo=X


def ray_address(address: str | None) -> str | None:
    """The cluster a run joins: `ray.address`, else RAY_ADDRESS (a Ray Job's driver); None: a
    fresh local Ray."""
    return address or os.environ.get("RAY_ADDRESS")


def silo_selector(cfg: FederationConfig, silo: str) -> dict[str, str] | None:
    """The labels silo `silo`'s node must carry, or None for any node."""
    own = cfg.silos.get(silo)
    if own is not None and own.node_label:
        return dict(own.node_label)
    return {SILO_LABEL: silo} if cfg.ray.placement == "per_node" else None


def describe_labels(selector: Mapping[str, str]) -> str:
    """Node labels as `ray start --labels` takes them: k=v,k=v."""
    return ",".join(f"{k}={v}" for k, v in selector.items())


def check_node_label(labels: dict[str, str] | None, key: str) -> None:
    """A node label selector is a non-empty mapping of valid label keys to valid values."""
    if labels is None:
        return
    if not labels:
        raise ConfigError(f"{key}: got {{}}, expected at least one label, e.g. {{silo: cleveland}}")
    for name, value in labels.items():
        prefix, _, bare = str(name).rpartition("/")
        if not _LABEL_NAME.match(bare) or (prefix and not _LABEL_PREFIX.match(prefix)):
            raise ConfigError(
                f"{key}: label key {name!r} is not valid; expected [prefix/]name of letters, "
                "digits, '-', '_' and '.', e.g. silo"
            )
        if not _LABEL_NAME.match(str(value)):
            raise ConfigError(
                f"{key}.{name}: got {value!r}, expected a label value of letters, digits, '-', "
                "'_' and '.' (at most 63), e.g. cleveland"
            )


def merge_config(base: Any = None, overrides: list[str] | None = None) -> FederationConfig:
    """Merge a mapping (or DictConfig) with `key=value` overrides into the structure, and check
    the values that need no registry."""
    parts = [base] if base is not None else []  # a plain mapping is taken as written
    merged = merge_structured(FederationConfig, *parts, _parse_overrides(overrides or []))
    try:
        cfg: FederationConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except OmegaConfBaseException as exc:
        raise omegaconf_error(exc) from None
    check_ranges(cfg)
    return cfg


def to_dict(cfg: FederationConfig) -> dict[str, Any]:
    """A plain, JSON-able dict of the resolved config (what crosses process boundaries)."""
    return dataclasses.asdict(cfg)
