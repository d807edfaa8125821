"""A plugin for tests/test_packing.py (config `plugins: [rng_plugins]`): FedAvg whose every batch
draws from torch's global generator, as dropout or any stochastic layer would, so a silo's
results depend on that generator's stream being its own."""

from __future__ import annotations

import torch
from torch import nn

from silo_pfl.algorithms import register
from silo_pfl.algorithms.fedavg import FedAvg


@register
class GlobalNoise(FedAvg):
    """FedAvg plus a loss term scaled by a draw from torch's global generator."""

    name = "global_noise"

    def extra_loss(
        self, model: nn.Module, reference: dict[str, torch.Tensor]
    ) -> torch.Tensor | None:
        weight = torch.rand(())
        return weight * sum((param**2).sum() for param in model.parameters()) * 1e-2
