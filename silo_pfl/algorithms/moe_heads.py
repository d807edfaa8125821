"""Mixture-of-experts heads: the model's Linear head becomes E expert heads shared by every silo,
mixed per example by a personal gate on the body's features (see models.MoEHead).

Split: the default rule `pattern:head.gate.*` keeps the gate local and shares the experts and the
body like any global layer. The rule `head` (and `last:1`) matches every head.* key, experts
included, so `split.local=[head]` makes the whole mixture personal, as FedPer's head is; a split
that leaves a gate key global is refused, since the gate is what personalises.

With `class_bias` > 0, each expert starts favouring its class(es) (with as many experts as
classes, one each), so the personal gate can choose classes through the shared experts; with one
expert the model is the plain model and the procedure is FedAvg's.
"""

from __future__ import annotations

from dataclasses import dataclass

from silo_pfl.algorithms import register
from silo_pfl.algorithms.base import Algorithm, Phase, require_at_least
from silo_pfl.config import FederationConfig
from silo_pfl.errors import ConfigError
from silo_pfl.models import LINEAR_HEAD_MODELS, BodyHeadModel, MoEHead
from silo_pfl.split import Split

GATE = "head.gate."


MAX_EXPERTS = 1024


@dataclass
class MoEHeadsParams:
    """moe_heads's options."""

    experts: int = 4  # expert heads, each like the model's Linear head
    # Added at init to each expert's bias on its class(es) (see MoEHead); 0: plain experts.
    class_bias: float = 0.0
    gate_warmup_epochs: int = 1  # gate-only epochs on the new global layers, each round

    def validate(self) -> None:
        require_at_least("algorithm.moe_heads", self, 1, "experts")
        if self.experts > MAX_EXPERTS:  # each is a copy of the head, built by the config's check
            raise ConfigError(
                f"algorithm.moe_heads.experts: got {self.experts}, expected 1 to {MAX_EXPERTS}"
            )
        require_at_least("algorithm.moe_heads", self, 0, "class_bias", "gate_warmup_epochs")

    def unused(self) -> list[tuple[str, tuple[str, ...], str]]:
        """Options the others make do nothing (silo_pfl.unused_settings)."""
        if self.experts == 1:
            return [("experts is 1", ("class_bias",), "a single expert is given no class bias")]
        return []


@register
class MoEHeads(Algorithm):
    """Warm the personal gate up on the new shared layers, then train everything together."""

    name = "moe_heads"
    Params = MoEHeadsParams
    default_local_rules = (f"pattern:{GATE}*",)
    needs_local_keys = True

    def check_config(self, cfg: FederationConfig) -> None:
        super().check_config(cfg)
        if cfg.model.name not in LINEAR_HEAD_MODELS:
            allowed = ", ".join(sorted(LINEAR_HEAD_MODELS))
            raise ConfigError(
                f"model.name: algorithm moe_heads replaces a single Linear head by experts, and "
                f"{cfg.model.name}'s head is not one; use one of {allowed}"
            )

    def prepare_model(self, model: BodyHeadModel) -> BodyHeadModel:
        model.head = MoEHead.from_head(model.head, self.params.experts, self.params.class_bias)
        return model

    def phases(self) -> list[Phase]:
        warmup = self.params.gate_warmup_epochs
        joint = [Phase("all", self.train.local_epochs)]
        return [Phase("local", warmup), *joint] if warmup else joint

    def check_split(self, split: Split) -> None:
        super().check_split(split)
        shared = [key for key in split.global_keys if key.startswith(GATE)]
        if shared:
            raise ConfigError(
                f"split.local: {shared[0]} is global, but moe_heads's gate is personal; add "
                f"pattern:{GATE}* (or head, which makes the experts personal too)"
            )
