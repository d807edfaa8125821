"""A plugin for tests/test_packing.py (config `plugins: [rng_plugins]`): FedAvg whose every batch
draws from torch's, numpy's and Python's global generators, as dropout, a stochastic layer or an
augmentation would, so a silo's results depend on each generator's stream being its own. numpy's
draw is one Gaussian a batch: numpy caches every second one, which a silo must keep too."""

from __future__ import annotations

import random

import numpy as np
import torch
from torch import nn

from silo_pfl.algorithms import register
from silo_pfl.algorithms.fedavg import FedAvg


@register
class GlobalNoise(FedAvg):
    """FedAvg plus a loss term scaled by draws from the global generators."""

    name = "global_noise"

    def extra_loss(
        self, model: nn.Module, reference: dict[str, torch.Tensor]
    ) -> torch.Tensor | None:
        weight = torch.rand(()) + 1e-3 * float(np.random.standard_normal()) + 1e-3 * random.random()
        return weight * sum((param**2).sum() for param in model.parameters()) * 1e-2
