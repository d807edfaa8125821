"""LG-FedAvg (Liang et al., 2020): the reverse of FedPer. Each silo keeps its first body blocks
(its local representation) and shares the rest of the body and the head."""

from dataclasses import dataclass

from silo_pfl.algorithms import register
from silo_pfl.algorithms.base import Algorithm, require_at_least


@dataclass
class LgFedAvgParams:
    """LG-FedAvg's options."""

    local_blocks: int = 1  # how many of the first blocks (models.blocks) stay on the silo

    def validate(self) -> None:
        require_at_least("algorithm.lg_fedavg", self, 1, "local_blocks")


@register
class LgFedAvg(Algorithm):
    """Train every key each round; the first `local_blocks` blocks never leave the silo."""

    name = "lg_fedavg"
    Params = LgFedAvgParams
    needs_local_keys = True
    rules_key = "algorithm.lg_fedavg.local_blocks"

    def local_rules(self) -> tuple[str, ...]:
        return (f"first:{self.params.local_blocks}",)
