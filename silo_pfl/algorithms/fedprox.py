"""FedProx (Li et al., 2020): FedAvg with a proximal term that holds local training near the
round's global model, limiting client drift on heterogeneous silos."""

from dataclasses import dataclass

import torch
from torch import nn

from silo_pfl.algorithms import register
from silo_pfl.algorithms.base import Algorithm, proximal_term, require_at_least


@dataclass
class FedProxParams:
    """FedProx's options; mu = 0 is FedAvg."""

    mu: float = 0.01  # weight of (mu / 2) * ||w - w_global||^2 over the global parameters

    def validate(self) -> None:
        require_at_least("algorithm.fedprox", self, 0, "mu")


@register
class FedProx(Algorithm):
    """Every key is global; each batch's loss adds (mu / 2) * ||w - w_global||^2."""

    name = "fedprox"
    Params = FedProxParams

    def extra_loss(
        self, model: nn.Module, reference: dict[str, torch.Tensor]
    ) -> torch.Tensor | None:
        return proximal_term(model, reference, self.params.mu)
