"""Cold start: the config of a silo that joins a trained federation.

The trained run decides what the federation is: its name, model, split, algorithm and server
(`FROM_TRAINED_RUN`); a key of those the user wrote with another value is refused, not dropped.
Its seed and data.* split the data, so the joining silo's must be the same, apart from what is the
silo's own (`OWN_DATA`): else its test rows could be rows the founders trained on. The joining
silo's job YAML and overrides decide everything else: its data (usually the same job with the silo
in data.late_silos), the rounds of local fitting, the training options, selection, Ray and
tracking. Its baseline, the same silo training alone, is the same config with algorithm `local`.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from collections.abc import Collection
from typing import Any

import numpy as np

from silo_pfl import builtin_names
from silo_pfl.algorithms import algorithm_config, build_algorithm
from silo_pfl.config import CENTRAL_MODELS, FederationConfig, flat, to_dict
from silo_pfl.data import all_silo_names, data_config
from silo_pfl.errors import ConfigError
from silo_pfl.messages import SiloOutcome
from silo_pfl.server_optimizers import resolve_server_optimizer
from silo_pfl.settings import build_config, split_rules
from silo_pfl.tracking.trained_run import TrainedRun

FROM_TRAINED_RUN = ("name", "model", "split", "algorithm", "server")
# The data.* keys that are the joining silo's own: the silos that sat out, its few-data cap, where
# its file is and what its label column is called. No founder's rows depend on them.
OWN_DATA = ("late_silos", "max_train_rows", "paths", "label_column")
# Compared even where `written` is unknown: a job names its federation and its model, and means
# its algorithm (fedavg where it names none).
NAMES = ("name", "model.name", "algorithm.name")


def joining_config(
    trained: TrainedRun,
    cfg: FederationConfig,
    silo: str,
    written: Collection[str] | None = None,
) -> FederationConfig:
    """The config silo `silo` joins `trained` with; a one-line ConfigError if it cannot: a
    founder or unknown silo, a seed or data split other than the run's, or a key of
    FROM_TRAINED_RUN written with another value. `written`: the keys the user wrote
    (config.written_keys); None takes those whose value is not the default, and NAMES."""
    _check_silo_of(cfg, silo)
    if silo in trained.founders:
        raise ConfigError(
            f"silo {silo}: a founding silo of run {trained.run_id}; onboarding is for a silo "
            "the federation did not train with (see data.late_silos)"
        )
    _check_data_split(trained, cfg)
    values = to_dict(cfg)
    values.update({key: trained.config[key] for key in FROM_TRAINED_RUN})
    if trained.config["algorithm"]["name"] not in builtin_names.ALGORITHMS:
        mine, theirs = values["plugins"], trained.config.get("plugins") or []
        values["plugins"] = [*mine, *(p for p in theirs if p not in mine and _importable(p))]
    values["aggregation"]["secure"] = False  # the joining silo sends nothing to mask
    values["privacy"] = _stricter(values["privacy"], trained.config.get("privacy") or {})
    if cfg.aggregation.secure or trained.config.get("aggregation", {}).get("secure"):
        values["privacy"]["label_counts"] = False  # as its founders, it keeps them
    joined = build_config(values)
    _check_written(trained, cfg, joined, written)
    return joined


def _importable(module: str) -> bool:
    """Whether a plugin of the trained run imports here: the one that registers its algorithm
    comes with it; others may be the founders' own, and are left out."""
    try:
        importlib.import_module(module)
    except Exception:
        return False
    return True


def _stricter(mine: dict[str, Any], founders: dict[str, Any]) -> dict[str, Any]:
    """The joining silo's privacy settings, none looser than the founders': what they kept out of
    the central store (a personalized model, per-class counts), the silo keeps out too."""
    order = CENTRAL_MODELS  # from the loosest to the strictest
    theirs = founders.get("central_models", order[0])
    central = max(mine["central_models"], theirs, key=order.index)
    counts = mine["label_counts"] and founders.get("label_counts", True)
    return {**mine, "central_models": central, "label_counts": counts}


def check_onboarding(cfg: FederationConfig, silo: str) -> None:
    """What an onboarding needs before it reads the trained run: a tracking store to read it
    from, and a silo of the job's data source (checked too before `submit --onboard`)."""
    if not cfg.tracking.enabled:
        raise ConfigError(
            "tracking.enabled: onboarding reads the trained federation from the tracking "
            "store; set tracking.enabled=true"
        )
    _check_silo_of(cfg, silo)


def _check_silo_of(cfg: FederationConfig, silo: str) -> None:
    names = all_silo_names(cfg.data)
    if silo not in names:
        raise ConfigError(
            f"silo {silo}: not a silo of data.source={cfg.data.source}; its silos are "
            f"{', '.join(names)}"
        )


def _check_data_split(trained: TrainedRun, cfg: FederationConfig) -> None:
    """The seed and every data.* key but OWN_DATA are the trained run's (a key the run's version
    did not have yet stands at its default)."""
    theirs_data = data_config(trained.config["data"])
    theirs = {"seed": trained.config.get("seed", 0), **_data_keys(theirs_data)}
    mine = {"seed": cfg.seed, **_data_keys(cfg.data)}
    if mine["data.source"] != theirs["data.source"]:
        keys = ["data.source"]
    else:
        keys = sorted(mine.keys() | theirs.keys(), key=lambda k: (k != "seed", k))
    own = ", ".join(f"data.{key}" for key in OWN_DATA)
    for key in keys:
        if mine.get(key) != theirs.get(key):
            raise ConfigError(
                f"{key}: got {mine.get(key)!r}, but run {trained.run_id} was trained with "
                f"{theirs.get(key)!r}; a joining silo's data is made and split as the founders' "
                f"was, so the seed and data.* are the trained run's (only {own} are its own)"
            )


def _data_keys(data: Any) -> dict[str, Any]:
    """data.* as dotted keys, as its JSON has them, less OWN_DATA."""
    values = json.loads(json.dumps(dataclasses.asdict(data), default=str))
    kept = {key: value for key, value in values.items() if key not in OWN_DATA}
    return flat(kept, "data.")


def _check_written(
    trained: TrainedRun,
    cfg: FederationConfig,
    joined: FederationConfig,
    written: Collection[str] | None,
) -> None:
    """Refuse a key of FROM_TRAINED_RUN the user wrote in `cfg` with a value other than the
    run's (`joined` has the run's; split.local compares the rules in force on each side)."""
    mine, theirs = _json_flat(cfg), flat(trained.config)
    absent = object()
    if written is None:
        defaults = _defaults(cfg)
        chosen = {k for k, v in mine.items() if k in NAMES or defaults.get(k, absent) != v}
    else:
        chosen = {k for k in mine if any(k == w or k.startswith(f"{w}.") for w in written)}
    decided = [k for k in chosen if k.split(".")[0] in FROM_TRAINED_RUN]
    mine["split.local"], theirs["split.local"] = split_rules(cfg), split_rules(joined)
    for key in sorted(decided, key=lambda k: (k not in NAMES, k)):
        before = theirs.get(key, absent)
        if before == mine[key]:
            continue
        was = "without it" if before is absent else f"with {before!r}"
        raise ConfigError(
            f"{key}: got {mine[key]!r}, but run {trained.run_id} was trained {was}; the trained "
            "run decides the name, model, split, algorithm and server: give its value or leave "
            "the key out"
        )


def _defaults(cfg: FederationConfig) -> dict[str, Any]:
    """Each key's value where a job does not write it, with cfg's algorithm and its sections
    (the server's step resolved as that algorithm's own)."""
    name = cfg.algorithm["name"]
    sections = {section: {} for section in cfg.algorithm if section != "name"}
    default = FederationConfig(algorithm=algorithm_config({**sections, "name": name}))
    own = build_algorithm(default.algorithm, default.train).server_optimizer
    resolve_server_optimizer(default.server, own, name)
    return _json_flat(default)


def _json_flat(cfg: FederationConfig) -> dict[str, Any]:
    """The config's keys and values as its saved JSON has them, flattened."""
    return flat(json.loads(json.dumps(to_dict(cfg), default=str)))


def alone_config(cfg: FederationConfig) -> FederationConfig:
    """The baseline: the same silo, data and training, with nothing federated."""
    values = to_dict(cfg)
    values["algorithm"] = {"name": "local"}
    values["split"] = {"local": None}
    return build_config(values)


def onboard_report(
    silo: str, trained: TrainedRun, joined: SiloOutcome, alone: SiloOutcome | None
) -> dict[str, Any]:
    """The joining silo against the founders and against training alone; a founders' mean of
    0 (or none) leaves its share NaN."""
    founders = trained.result.get("silos", {})
    accuracies = [float(s["test_accuracy"]) for s in founders.values()]
    founders_mean = float(np.mean(accuracies)) if accuracies else float("nan")
    report: dict[str, Any] = {
        "silo": silo,
        "trained_run_id": trained.run_id,
        "founders": list(founders),
        "founders_mean_test_accuracy": founders_mean,
        "founders_worst_test_accuracy": min(accuracies) if accuracies else float("nan"),
        "test_accuracy": joined.test_accuracy,
        "share_of_founders_mean": (
            joined.test_accuracy / founders_mean if founders_mean else float("nan")
        ),
    }
    if alone is not None:
        report.update(
            alone_test_accuracy=alone.test_accuracy,
            alone_val_accuracy=alone.val_accuracy,
            alone_selected_round=alone.selected_round,
            gain_over_alone=joined.test_accuracy - alone.test_accuracy,
        )
    return report
