"""Cold start: the config of a silo that joins a trained federation.

The trained run decides what the federation is: its name, model, split, algorithm and server
(`FROM_TRAINED_RUN`). The joining silo's job YAML and overrides decide everything else: its data
(usually the same job with the silo in data.late_silos), the rounds of local fitting, the training
options, selection, Ray and tracking. Its baseline, the same silo training alone, is the same
config with algorithm `local`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from silo_pfl.config import FederationConfig, to_dict
from silo_pfl.data import all_silo_names
from silo_pfl.errors import ConfigError
from silo_pfl.messages import SiloOutcome
from silo_pfl.settings import build_config
from silo_pfl.tracking.trained_run import TrainedRun

FROM_TRAINED_RUN = ("name", "model", "split", "algorithm", "server")


def joining_config(trained: TrainedRun, cfg: FederationConfig, silo: str) -> FederationConfig:
    """The config silo `silo` joins `trained` with; a one-line ConfigError if it cannot."""
    names = all_silo_names(cfg.data)
    if silo not in names:
        raise ConfigError(
            f"--silo {silo}: not a silo of data.source={cfg.data.source}; its silos are "
            f"{', '.join(names)}"
        )
    if silo in trained.founders:
        raise ConfigError(
            f"--silo {silo}: a founding silo of run {trained.run_id}; onboarding is for a silo "
            "the federation did not train with (see data.late_silos)"
        )
    values = to_dict(cfg)
    values.update({key: trained.config[key] for key in FROM_TRAINED_RUN})
    values["aggregation"]["secure"] = False  # the joining silo sends nothing to mask
    return build_config(values)


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
