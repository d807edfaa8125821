"""FedRep (Collins et al., 2021): fit the personal head on the frozen body, then the body."""

from dataclasses import dataclass

from silo_pfl.algorithms import register
from silo_pfl.algorithms.base import Algorithm, Phase, require_at_least


@dataclass
class FedRepParams:
    """FedRep's options; the paper uses many head epochs and one body epoch."""

    head_epochs: int = 5  # head only, body frozen
    body_epochs: int = 1  # body only, head frozen

    def validate(self) -> None:
        # Each part needs an epoch a round: with none the head stays at its random start, or
        # the body is never trained (Collins et al., Alg. 1).
        require_at_least("algorithm.fedrep", self, 1, "head_epochs", "body_epochs")


@register
class FedRep(Algorithm):
    """Alternate: head epochs with the body frozen, then body epochs with the head frozen."""

    name = "fedrep"
    Params = FedRepParams
    default_local_rules = ("head",)
    needs_local_keys = True
    ignores = {
        "train.local_epochs": "a round trains algorithm.fedrep.head_epochs, then "
        "algorithm.fedrep.body_epochs (only an onboarding's alone baseline reads it)"
    }

    def phases(self) -> list[Phase]:
        return [Phase("local", self.params.head_epochs), Phase("global", self.params.body_epochs)]
