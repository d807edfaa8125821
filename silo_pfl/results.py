"""The typed result of a federation run, and its JSON form."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from silo_pfl import durable
from silo_pfl.messages import SiloInfo, SiloOutcome, SplitInfo

if TYPE_CHECKING:
    from silo_pfl.config import FederationConfig
    from silo_pfl.run_dir import RunDir


@dataclass(frozen=True)
class RoundSummary:
    """One round, as the driver saw it."""

    round: int
    # From the driver's start of the round, or, when its fits were sent with the commits of
    # the round before, from that round's end: rounds do not overlap, and add up to the run's
    seconds: float
    mean_train_loss: float
    mean_val_accuracy: float
    mean_test_accuracy: float
    # the silos that committed the round: their training figures, and their validation and test
    # accuracies if it was evaluated
    silos: dict[str, dict[str, float]] = field(default_factory=dict)
    participants: list[str] = field(default_factory=list)  # silos whose updates were aggregated
    # silo -> why it was left out of the aggregate, or (if a participant) of the evaluation
    absent: dict[str, str] = field(default_factory=dict)
    attempts: int = 1  # 1, or more when a try had no quorum
    # silo -> how it rejoined after its process died: {round restored, local_digest, pid}
    restarted: dict[str, dict[str, Any]] = field(default_factory=dict)
    # False for a round between evaluations (eval.every): no silo has accuracies; their means NaN
    evaluated: bool = True


@dataclass(frozen=True)
class SiloResult:
    """One silo's selected personalized model, evaluated on its own held-out test set."""

    test_accuracy: float
    val_accuracy: float
    selected_round: int
    final_test_accuracy: float
    num_train: int
    num_val: int
    num_test: int
    bytes_sent_per_round: int
    node_id: str = ""
    restarts: int = 0  # times its process died and it rejoined
    rounds_taken_part: int = 0  # rounds whose aggregate held its update
    # The algorithm's figures of the selected model (e.g. APFL's alpha); flat keys in JSON.
    extras: dict[str, float] = field(default_factory=dict)
    joined: str = "founder"  # founder, or onboard: it joined the trained federation later

    @classmethod
    def of(cls, info: SiloInfo, outcome: SiloOutcome, **more: Any) -> SiloResult:
        """A silo's result from its set-up report and its outcome; `more` sets the rest."""
        return cls(
            test_accuracy=outcome.test_accuracy,
            val_accuracy=outcome.val_accuracy,
            selected_round=outcome.selected_round,
            final_test_accuracy=outcome.final_test_accuracy,
            num_train=info.num_train,
            num_val=info.num_val,
            num_test=info.num_test,
            node_id=info.node_id,
            extras=outcome.extras,
            **more,
        )


@dataclass(frozen=True)
class FederationResult:
    """Everything a run reports; `mean_test_accuracy` is the unweighted mean over silos."""

    name: str
    algorithm: str
    rounds: int
    seed: int
    wall_seconds: float
    global_parameters: int
    local_parameters: int
    silos: dict[str, SiloResult]
    history: list[RoundSummary]
    global_state_path: str = ""  # the global keys, in a file on the driver's own disk
    run_id: str = ""  # this run's directory is <output_dir>/<name>/<run_id>/
    run_dir: str = ""
    server_node_id: str = ""  # the Ray node the server actor ran on
    # What callbacks add (e.g. "mlflow": where the run and models are); top-level keys in JSON.
    extras: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(
        cls, cfg: FederationConfig, run_dir: RunDir, split: SplitInfo, **more: Any
    ) -> FederationResult:
        """A run's result: the config's name, algorithm, rounds and seed, the split's parameter
        counts and the run's directory; `more` sets the rest."""
        return cls(
            name=cfg.name,
            algorithm=cfg.algorithm["name"],
            rounds=cfg.rounds,
            seed=cfg.seed,
            global_parameters=split.global_parameters,
            local_parameters=split.local_parameters,
            run_id=run_dir.run_id,
            run_dir=str(run_dir.path.resolve()),
            **more,
        )

    @property
    def test_accuracies(self) -> list[float]:
        return [s.test_accuracy for s in self.silos.values()]

    @property
    def mean_test_accuracy(self) -> float:
        return float(np.mean(self.test_accuracies))

    @property
    def worst_test_accuracy(self) -> float:
        return float(np.min(self.test_accuracies))

    @property
    def std_test_accuracy(self) -> float:
        return float(np.std(self.test_accuracies))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able summary: the headline figures first, then silos, history and extras."""
        data = dataclasses.asdict(self)
        headline = {
            "name": self.name,
            "algorithm": self.algorithm,
            "rounds": self.rounds,
            "seed": self.seed,
            "wall_seconds": self.wall_seconds,
            "mean_test_accuracy": self.mean_test_accuracy,
            "worst_test_accuracy": self.worst_test_accuracy,
            "std_test_accuracy": self.std_test_accuracy,
            "global_parameters": self.global_parameters,
            "local_parameters": self.local_parameters,
        }
        for silo in data["silos"].values():
            silo.update(silo.pop("extras"))
        rest = {k: v for k, v in data.items() if k not in headline and k != "extras"}
        extras = {k: v for k, v in self.extras.items() if k not in headline and k not in data}
        return {**headline, **rest, **extras}

    def write_json(self, path: str | Path) -> None:
        """Write the summary atomically: the file is either whole or absent."""
        write_json_atomic(path, self.to_dict())


def json_text(data: Any) -> str:
    """`data` as a run's JSON files hold it: a figure that is not finite (a round's accuracy
    between evaluations: NaN) as null, so that any JSON parser reads it."""
    return json.dumps(finite_or_null(data), indent=2, default=json_default, allow_nan=False) + "\n"


def write_json_atomic(path: str | Path, data: Any) -> None:
    """Write `json_text(data)` to a temporary file beside `path`, then rename it into place,
    durably (a run's record must survive a power cut whole: `durable.write_atomic`)."""
    durable.write_atomic(Path(path), json_text(data).encode())


def finite_or_null(value: Any) -> Any:
    """`value` with every float that is not finite, in any mapping or list, as None."""
    if isinstance(value, dict):
        return {key: finite_or_null(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(item) for item in value]
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else None
    return value


def json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, tuple):
        return list(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")
