"""FedPer (Arivazhagan et al., 2019): the head is personal, the base layers are shared."""

from dataclasses import dataclass

from silo_pfl.algorithms import register
from silo_pfl.algorithms.base import Algorithm, Phase
from silo_pfl.errors import ConfigError


@dataclass
class FedPerParams:
    """FedPer's options."""

    head_warmup_epochs: int = 0  # head-only epochs before the joint epochs, each round

    def validate(self) -> None:
        if self.head_warmup_epochs < 0:
            raise ConfigError(
                f"algorithm.fedper.head_warmup_epochs: got {self.head_warmup_epochs}, expected >= 0"
            )


@register
class FedPer(Algorithm):
    """Train body and personal head together; optionally warm the head up on the new body first."""

    name = "fedper"
    Params = FedPerParams
    default_local_rules = ("head",)

    def phases(self) -> list[Phase]:
        warmup = self.params.head_warmup_epochs
        joint = [Phase("all", self.train.local_epochs)]
        return [Phase("local", warmup), *joint] if warmup else joint
