"""Ditto (Li et al., 2021): FedAvg for the global model, and beside it a personal model per
silo, trained each round with a pull of strength lam towards that round's global model."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from silo_pfl.algorithms import register
from silo_pfl.algorithms.base import (
    Algorithm,
    Phase,
    SiloTrainer,
    proximal_term,
    require_at_least,
)

PREFIX = "ditto.personal."


@dataclass
class DittoParams:
    """Ditto's options."""

    lam: float = 0.1  # weight of (lam / 2) * ||v - w_global||^2 in the personal model's loss
    personal_epochs: int = 1  # epochs of the personal model each round

    def validate(self) -> None:
        require_at_least("algorithm.ditto", self, 0, "lam")
        require_at_least("algorithm.ditto", self, 1, "personal_epochs")  # 0: v never trains


@register
class Ditto(Algorithm):
    """The silo's model is FedAvg's; its personal model never leaves the silo."""

    name = "ditto"
    Params = DittoParams

    def __init__(self, params: DittoParams, train) -> None:
        super().__init__(params, train)
        self.personal: nn.Module | None = None

    def after_fit(
        self, silo: SiloTrainer, reference: dict[str, torch.Tensor], round_: int
    ) -> float:
        if self.personal is None:  # starts as the first global model
            self.personal = copy.deepcopy(silo.model)
            self.personal.load_state_dict(reference, strict=False)
        lam = self.params.lam
        return silo.train(
            self.personal,
            Phase("all", self.params.personal_epochs),
            round_,
            lambda model: proximal_term(model, reference, lam),
            purpose="personal",
        )

    def personalized_model(self, silo: SiloTrainer, round_: int) -> nn.Module:
        return self.personal if self.personal is not None else silo.model

    def local_state(self) -> dict[str, torch.Tensor]:
        if self.personal is None:
            return {}
        return {f"{PREFIX}{k}": v for k, v in self.personal.state_dict().items()}

    def load_local_state(self, silo: SiloTrainer, state: dict[str, torch.Tensor]) -> None:
        if not state:
            self.personal = None
            return
        self.personal = copy.deepcopy(silo.model)
        self.personal.load_state_dict({k[len(PREFIX) :]: v for k, v in state.items()})
