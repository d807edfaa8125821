"""A plugin for tests/test_strategies.py (config `plugins: [strategy_plugins]`): an algorithm
whose server part needs every update in the clear, so it must refuse aggregation.secure."""

from __future__ import annotations

from silo_pfl.algorithms import register
from silo_pfl.algorithms.base import Algorithm
from silo_pfl.algorithms.scaffold import Scaffold
from silo_pfl.strategy import ServerStrategy


class MedianStrategy(ServerStrategy):
    """Stands for a robust aggregate (a coordinate-wise median), which no sum can give."""

    secure_refusal = "needs each silo's update in the clear (a median is not a sum)"


@register
class MedianFedAvg(Algorithm):
    """FedAvg with the strategy above."""

    name = "median_fedavg"
    Strategy = MedianStrategy


@register
class LeakyScaffold(Scaffold):
    """SCAFFOLD with a bug: its control-variate extra also carries a local key's values."""

    name = "leaky_scaffold"

    def update_extras(self, silo, reference):
        extras = super().update_extras(silo, reference)
        local = silo.split.local_keys[0]
        leaked = silo.model.state_dict()[local].numpy()
        return {name: {**values, local: leaked} for name, values in extras.items()}
