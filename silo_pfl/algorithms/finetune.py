"""Local fine-tuning: FedAvg's global model, fine-tuned on each silo's own data before it is
judged, selected and served; the fine-tuned copy never leaves the silo."""

from __future__ import annotations

import copy
from dataclasses import dataclass

from torch import nn

from silo_pfl.algorithms import register
from silo_pfl.algorithms.base import Algorithm, Phase, SiloTrainer, require_at_least
from silo_pfl.errors import ConfigError


@dataclass
class FineTuneParams:
    """Fine-tuning's options."""

    epochs: int = 1  # epochs on the silo's training rows, from each round's global model
    trainable: str = "all"  # all | local | global: which keys the fine-tuning updates

    def validate(self) -> None:
        require_at_least("algorithm.finetune", self, 0, "epochs")
        if self.trainable not in ("all", "local", "global"):
            raise ConfigError(
                f"algorithm.finetune.trainable: got {self.trainable!r}, expected one of all, "
                "local, global"
            )

    def unused(self) -> list[tuple[str, tuple[str, ...], str]]:
        """Options the others make do nothing (silo_pfl.unused_settings)."""
        if self.epochs == 0:
            return [("epochs is 0", ("trainable",), "no fine-tuning runs")]
        return []


@register
class FineTune(Algorithm):
    """Train like FedAvg; personalize a copy of each round's model by local epochs."""

    name = "finetune"
    Params = FineTuneParams

    def trains_local_keys(self) -> bool:
        """Fine-tuning only the local keys needs some."""
        return self.params.trainable == "local" and self.params.epochs > 0

    def personalized_model(self, silo: SiloTrainer, round_: int) -> nn.Module:
        model = copy.deepcopy(silo.model)
        phase = Phase(self.params.trainable, self.params.epochs)  # type: ignore[arg-type]
        silo.train(model, phase, round_, None, purpose="finetune")
        return model
