"""What an algorithm may change about the shared training loop, with defaults that are FedAvg.

An algorithm is a small class: its config dataclass, the split rules it defaults to, the phases
of its local procedure, an optional extra loss term, and optional personal work in the silo
(after the round's update; when the silo's personalized model is made). Each silo has its own
instance. The silo and the orchestrator call only these hooks, never an algorithm by name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol

import numpy as np
import torch
from torch import nn

from silo_pfl.aggregation import State
from silo_pfl.config import FederationConfig, TrainConfig
from silo_pfl.errors import ConfigError
from silo_pfl.models import BodyHeadModel
from silo_pfl.optim import Optimizer
from silo_pfl.split import Split, check_split
from silo_pfl.strategy import ServerStrategy
from silo_pfl.training import make_optimizer

Trainable = Literal["all", "global", "local"]


@dataclass(frozen=True)
class Phase:
    """Train the parameters in `trainable` for `epochs` epochs, or until `steps` optimizer steps
    if set; the others stay frozen."""

    trainable: Trainable
    epochs: int
    steps: int | None = None


def require_at_least(section: str, params: object, minimum: float, *keys: str) -> None:
    """Raise a one-line ConfigError for the first option in `keys` below `minimum`."""
    for key in keys:
        value = getattr(params, key)
        if value < minimum:
            raise ConfigError(f"{section}.{key}: got {value}, expected >= {minimum}")


class SiloTrainer(Protocol):
    """What a silo offers its algorithm's hooks: its model and the shared loop on its data."""

    model: nn.Module  # the silo's model: the global keys it holds now, and its local keys
    val_xy: tuple[torch.Tensor, torch.Tensor]  # its validation rows (inputs, labels)
    num_examples: int  # the rows it trains on: its weight in the aggregate

    def train(
        self,
        model: nn.Module,
        phase: Phase,
        round_: int,
        extra_loss: Callable[[nn.Module], torch.Tensor | None] | None,
        purpose: str = "",
    ) -> float:
        """Train `model` for one phase on the silo's training rows; `purpose` seeds its shuffle."""
        ...


def proximal_term(
    model: nn.Module, reference: dict[str, torch.Tensor], weight: float
) -> torch.Tensor | None:
    """(weight / 2) * ||w - reference||^2 over the trainable parameters named in `reference`."""
    if weight == 0:
        return None
    terms = [
        (param - reference[name]).pow(2).sum()
        for name, param in model.named_parameters()
        if param.requires_grad and name in reference
    ]
    return 0.5 * weight * torch.stack(terms).sum() if terms else None


@dataclass
class NoParams:
    """An algorithm with no parameters of its own."""


class Algorithm:
    """Base class: one local phase over every parameter, no extra loss, nothing kept local."""

    name: ClassVar[str] = ""
    Params: ClassVar[type] = NoParams
    # Split rules used when the job does not set split.local.
    default_local_rules: ClassVar[tuple[str, ...]] = ()
    # The config key that decides `local_rules`, named when they do not fit the model.
    rules_key: ClassVar[str] = "algorithm.name"
    # Settings outside its own section that the algorithm never reads, and what it reads instead
    # (silo_pfl.unused_settings warns of a job that sets one).
    ignores: ClassVar[dict[str, str]] = {}
    # The split must leave some global keys: something to federate (only `local` needs none).
    needs_global_keys: ClassVar[bool] = True
    # The split must leave some local keys: the procedure trains or keeps personal keys.
    needs_local_keys: ClassVar[bool] = False
    # The server's part: how the round's aggregate becomes the new global keys, and the names
    # of the extras each update carries (see silo_pfl.strategy).
    Strategy: ClassVar[type[ServerStrategy]] = ServerStrategy
    # The server optimizer this algorithm stands for (fedadam: adam); None: server.optimizer's.
    server_optimizer: ClassVar[str | None] = None
    # The server's state mirrors `local_state` as a fit leaves it (SCAFFOLD's c is the mean of
    # the silos' c_i): once the update is aggregated, that state must outlive the silo's process.
    server_mirrors_state: ClassVar[bool] = False

    def __init__(self, params: object, train: TrainConfig) -> None:
        self.params = params
        self.train = train

    def check_config(self, cfg: FederationConfig) -> None:
        """At load: raise a one-line ConfigError if this algorithm cannot run the job (its model,
        its optimizer, secure aggregation)."""
        refusal = self.Strategy.secure_refusal
        if cfg.aggregation.secure and refusal:
            raise ConfigError(
                f"aggregation.secure: algorithm {self.name} {refusal}; turn secure off or choose "
                "another algorithm"
            )

    def check_batches(self, silo: str, rows: int, per_epoch: int) -> None:
        """At a silo's build: raise a one-line FederationError naming `silo` if its `rows`
        training rows, `per_epoch` batches an epoch, leave this procedure no step to take. The
        loop's plain steps need one batch."""
        return None

    def server_strategy(self, global_state: State) -> ServerStrategy:
        """The server's part of this algorithm, over the initial global keys."""
        return self.Strategy(global_state)

    def begin_round(
        self, silo: SiloTrainer, reference: dict[str, torch.Tensor], broadcast: dict[str, Any]
    ) -> None:
        """Before the round's training: what the server's strategy broadcast (control variates)."""

    def update_extras(
        self, silo: SiloTrainer, reference: dict[str, torch.Tensor]
    ) -> dict[str, dict[str, np.ndarray]]:
        """After the round's training: the named extras sent beside the delta, each keyed by the
        global keys (exactly `Strategy.extras`)."""
        return {}

    def local_rules(self) -> tuple[str, ...]:
        """The split rules used when the job does not set split.local."""
        return self.default_local_rules

    def prepare_model(self, model: BodyHeadModel) -> BodyHeadModel:
        """The federation's model as this algorithm needs it (MoE heads replace the head);
        applied identically on every silo and on the server."""
        return model

    def phases(self) -> list[Phase]:
        """The local procedure of one round, as phases of the shared loop."""
        return [Phase("all", self.train.local_epochs)]

    def optimizer(self, params: list[nn.Parameter], phase: Phase, purpose: str) -> Optimizer:
        """The optimizer of one phase of the shared loop; `purpose` is the silo.train's."""
        return make_optimizer(params, self.train)

    def trains_local_keys(self) -> bool:
        """Whether this instance's procedure needs local keys: the class says so, or a phase
        trains the local keys alone."""
        return self.needs_local_keys or any(
            phase.trainable == "local" and phase.epochs > 0 for phase in self.phases()
        )

    def check_split(self, split: Split) -> None:
        """Raise a one-line ConfigError if `split` leaves no keys of a kind this procedure needs."""
        check_split(split, self.name, self.needs_global_keys, self.trains_local_keys())

    def extra_loss(
        self, model: nn.Module, reference: dict[str, torch.Tensor]
    ) -> torch.Tensor | None:
        """A term added to every batch's loss, for its gradients; `reference` is the round's
        incoming global state. The loss a silo reports is the cross-entropy without it."""
        return None

    def after_fit(
        self, silo: SiloTrainer, reference: dict[str, torch.Tensor], round_: int
    ) -> float | None:
        """Personal work once the round's update is made (Ditto trains its personal model);
        the mean loss of what it trained, if it trained anything."""
        return None

    def personalized_model(self, silo: SiloTrainer, round_: int) -> nn.Module:
        """The model this silo is judged, selected and served by, made after aggregation."""
        return silo.model

    def report(self) -> dict[str, float]:
        """Per-silo figures of the current personalized model (APFL's alpha), reported with the
        selected model in the results and MLflow."""
        return {}

    def local_state(self) -> dict[str, torch.Tensor]:
        """State this algorithm keeps in the silo, checkpointed with the silo's local keys."""
        return {}

    def load_local_state(self, silo: SiloTrainer, state: dict[str, torch.Tensor]) -> None:
        """Restore what `local_state` returned (empty: the state before round 1)."""
