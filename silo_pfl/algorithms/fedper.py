"""FedPer (Arivazhagan et al., 2019): the head is personal, the base layers are shared."""

from dataclasses import dataclass

from silo_pfl.algorithms import register
from silo_pfl.algorithms.base import Algorithm, Phase, require_at_least


@dataclass
class FedPerParams:
    """FedPer's options."""

    head_warmup_epochs: int = 0  # head-only epochs before the joint epochs, each round

    def validate(self) -> None:
        require_at_least("algorithm.fedper", self, 0, "head_warmup_epochs")


@register
class FedPer(Algorithm):
    """Train body and personal head together; optionally warm the head up on the new body first."""

    name = "fedper"
    Params = FedPerParams
    default_local_rules = ("head",)
    needs_local_keys = True

    def phases(self) -> list[Phase]:
        warmup = self.params.head_warmup_epochs
        joint = [Phase("all", self.train.local_epochs)]
        return [Phase("local", warmup), *joint] if warmup else joint
