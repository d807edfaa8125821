"""What an algorithm may change about the shared training loop, with defaults that are FedAvg.

An algorithm is a small class: its config dataclass, the split rules it defaults to, the phases
of its local procedure and an optional extra loss term. The silo and the orchestrator call only
these hooks, never an algorithm by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from torch import nn

from silo_pfl.config import TrainConfig
from silo_pfl.errors import ConfigError

Trainable = Literal["all", "global", "local"]


@dataclass(frozen=True)
class Phase:
    """Train the parameters in `trainable` for `epochs` epochs; the others stay frozen."""

    trainable: Trainable
    epochs: int


def require_at_least(section: str, params: object, minimum: float, *keys: str) -> None:
    """Raise a one-line ConfigError for the first option in `keys` below `minimum`."""
    for key in keys:
        value = getattr(params, key)
        if value < minimum:
            raise ConfigError(f"{section}.{key}: got {value}, expected >= {minimum}")


@dataclass
class NoParams:
    """An algorithm with no parameters of its own."""


class Algorithm:
    """Base class: one local phase over every parameter, no extra loss, nothing kept local."""

    name: ClassVar[str] = ""
    Params: ClassVar[type] = NoParams
    # Split rules used when the job does not set split.local.
    default_local_rules: ClassVar[tuple[str, ...]] = ()

    def __init__(self, params: object, train: TrainConfig) -> None:
        self.params = params
        self.train = train

    def phases(self) -> list[Phase]:
        """The local procedure of one round, as phases of the shared loop."""
        return [Phase("all", self.train.local_epochs)]

    def extra_loss(
        self, model: nn.Module, reference: dict[str, torch.Tensor]
    ) -> torch.Tensor | None:
        """A term added to every batch's loss; `reference` is the round's incoming global state."""
        return None
