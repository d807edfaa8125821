"""APFL (Deng et al., 2020): FedAvg for the global model w, and beside it in each silo a personal
model v and a mixing weight alpha. The silo is judged by the mixture of their parameters,
alpha * v + (1 - alpha) * w; v and alpha never leave the silo.

Each round, after w's FedAvg update, v takes `personal_epochs` of the shared loop. alpha is one of:
  learned   v and alpha train together on the loss of the mixed model, w frozen at the round's
            incoming global model; alpha by plain SGD of step `alpha_lr`, projected onto [0, 1]
            after each step
  a number  fixed; v trains on the loss of the mixed model as above
  grid      v trains alone (on its own loss, so a small alpha never starves it); at every
            evaluation each silo takes the value of `grid` whose mixed model has the best
            accuracy (then loss) on its own validation rows
Floating-point buffers (BatchNorm statistics) mix like parameters; v's are updated while the
mixture trains; integer buffers are w's. alpha = 0 is exactly w, alpha = 1 exactly v.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.func import functional_call

from silo_pfl.algorithms import register
from silo_pfl.algorithms.base import Algorithm, Phase, SiloTrainer, require_at_least
from silo_pfl.config import FederationConfig, TrainConfig
from silo_pfl.errors import ConfigError
from silo_pfl.optim import Closure, Optimizer
from silo_pfl.training import evaluate
from silo_pfl.unused_settings import Finding

PREFIX = "apfl.personal."
ALPHA = "apfl.alpha"


def _in_unit_interval(value: object) -> bool:
    """A number (not a list, which OmegaConf's list of floats lets through nested) in [0, 1]."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0.0 <= value <= 1.0


@dataclass
class APFLParams:
    """APFL's options."""

    alpha: str = "grid"  # learned | grid | a fixed number in [0, 1]
    grid: list[float] = field(default_factory=lambda: [i / 10 for i in range(11)])
    alpha_init: float = 0.5  # learned: alpha before its first step; grid: before a choice
    alpha_lr: float = 0.3  # learned: SGD step of alpha
    personal_epochs: int = 1  # epochs of v (and a learned alpha) each round

    def unused(self) -> list[Finding]:
        """Options the others make do nothing (silo_pfl.unused_settings)."""
        condition = f"alpha is {self.alpha}"
        if self.alpha == "grid":
            return [(condition, ("alpha_lr",), "only alpha=learned reads {it}")]
        if self.alpha == "learned":
            return [(condition, ("grid",), "only alpha=grid reads {it}")]
        keys = ("grid", "alpha_init", "alpha_lr")
        return [(condition, keys, "only alpha=grid or alpha=learned reads {it}")]

    def fixed_alpha(self) -> float | None:
        """The fixed alpha, or None if it is learned or chosen on the grid."""
        return None if self.alpha in ("learned", "grid") else float(self.alpha)

    def validate(self) -> None:
        require_at_least("algorithm.apfl", self, 0, "alpha_lr")
        require_at_least("algorithm.apfl", self, 1, "personal_epochs")  # 0: v never trains
        if self.alpha not in ("learned", "grid"):
            try:
                valid = _in_unit_interval(float(self.alpha))
            except ValueError:
                valid = False
            if not valid:
                raise ConfigError(
                    f"algorithm.apfl.alpha: got {self.alpha!r}, expected learned, grid or a "
                    "number in [0, 1]"
                )
        if not self.grid or not all(_in_unit_interval(a) for a in self.grid):
            raise ConfigError(
                f"algorithm.apfl.grid: got {list(self.grid)}, expected a non-empty list of "
                "numbers in [0, 1]"
            )
        if not _in_unit_interval(self.alpha_init):
            raise ConfigError(
                f"algorithm.apfl.alpha_init: got {self.alpha_init}, expected a number in [0, 1]"
            )


def mix(v: torch.Tensor, w: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """alpha * v + (1 - alpha) * w: exactly w at alpha = 0 and exactly v at alpha = 1."""
    return alpha * v + (1 - alpha) * w


class Mixture(nn.Module):
    """The mixed model over a frozen w, for the shared loop: its parameters are v's, and alpha
    when it is learned (else alpha is a buffer); its forward is v's network run on the mixed
    parameters and v's buffers."""

    def __init__(
        self, personal: nn.Module, frozen: dict[str, torch.Tensor], alpha: float, learn: bool
    ) -> None:
        super().__init__()
        self.personal = personal
        self.frozen = frozen
        value = torch.tensor(alpha, dtype=torch.float32)
        if learn:
            self.alpha = nn.Parameter(value)
        else:
            self.register_buffer("alpha", value)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mixed = {
            name: mix(param, self.frozen[name], self.alpha)
            for name, param in self.personal.named_parameters()
        }
        return functional_call(self.personal, mixed, (x,))


class ProjectedAlpha(Optimizer):
    """The job's optimizer for v, and plain SGD for alpha, projected onto [0, 1] after each step."""

    def __init__(self, inner: Optimizer, alpha: nn.Parameter, lr: float) -> None:
        super().__init__([*inner.params, alpha])
        self.inner, self.alpha, self.lr = inner, alpha, lr

    @torch.no_grad()
    def step(self, closure: Closure | None = None) -> None:
        self.inner.step(closure)
        if self.alpha.grad is not None:
            self.alpha.sub_(self.lr * self.alpha.grad).clamp_(0.0, 1.0)


@register
class APFL(Algorithm):
    """The silo's model is FedAvg's w; it is judged by its mixture with its personal model v."""

    name = "apfl"
    Params = APFLParams

    def __init__(self, params: APFLParams, train: TrainConfig) -> None:
        super().__init__(params, train)
        self.personal: nn.Module | None = None
        self.alpha = self._initial_alpha()
        self._learning: Mixture | None = None  # the mixture being trained, while it is

    def check_config(self, cfg: FederationConfig) -> None:
        super().check_config(cfg)
        if self.params.alpha == "grid" and getattr(cfg.data, "val_fraction", None) == 0:
            raise ConfigError(
                "algorithm.apfl.alpha: grid chooses alpha on each silo's validation rows, but "
                "data.val_fraction=0 leaves none; set data.val_fraction above 0, or alpha to "
                "learned or a number in [0, 1]"
            )

    def _initial_alpha(self) -> float:
        fixed = self.params.fixed_alpha()
        return self.params.alpha_init if fixed is None else fixed

    def after_fit(
        self, silo: SiloTrainer, reference: dict[str, torch.Tensor], round_: int
    ) -> float:
        if self.personal is None:  # starts as the first global model
            self.personal = copy.deepcopy(silo.model)
            self.personal.load_state_dict(reference, strict=False)
        phase = Phase("all", self.params.personal_epochs)
        if self.params.alpha == "grid":
            return silo.train(self.personal, phase, round_, None, purpose="apfl")
        frozen = {k: reference.get(k, p).detach() for k, p in silo.model.named_parameters()}
        mixture = Mixture(self.personal, frozen, self.alpha, self.params.alpha == "learned")
        self._learning = mixture
        try:
            loss = silo.train(mixture, phase, round_, None, purpose="apfl")
        finally:
            self._learning = None
        self.alpha = float(mixture.alpha.detach())
        return loss

    def optimizer(self, params: list[nn.Parameter], phase: Phase, purpose: str) -> Optimizer:
        alpha = self._learning.alpha if self._learning is not None else None
        if not isinstance(alpha, nn.Parameter) or not any(p is alpha for p in params):
            return super().optimizer(params, phase, purpose)
        inner = super().optimizer([p for p in params if p is not alpha], phase, purpose)
        return ProjectedAlpha(inner, alpha, self.params.alpha_lr)

    def mixed_model(
        self, model: nn.Module, alpha: float, into: nn.Module | None = None
    ) -> nn.Module:
        """`into` (by default a new copy of `model`, w) holding alpha * v + (1 - alpha) * w in
        every float entry."""
        assert self.personal is not None
        mixed = copy.deepcopy(model) if into is None else into
        weight = torch.tensor(alpha, dtype=torch.float32)
        personal = self.personal.state_dict()
        with torch.no_grad():
            state = {
                k: mix(personal[k], w, weight) if w.is_floating_point() else w
                for k, w in model.state_dict().items()
            }
        mixed.load_state_dict(state)
        return mixed

    def _best_on_validation(self, silo: SiloTrainer) -> float:
        """The grid's alpha whose mixed model has the best validation accuracy (then loss);
        the current alpha if the silo has no validation rows. One copy of w serves the grid."""
        best, best_score = self.alpha, (-math.inf, -math.inf)
        candidate = copy.deepcopy(silo.model)
        for alpha in self.params.grid:
            result = evaluate(self.mixed_model(silo.model, alpha, candidate), *silo.val_xy)
            if not math.isfinite(result.accuracy):
                return self.alpha
            score = (result.accuracy, -result.loss)
            if score > best_score:
                best, best_score = alpha, score
        return best

    def personalized_model(self, silo: SiloTrainer, round_: int) -> nn.Module:
        if self.personal is None:
            return silo.model
        if self.params.alpha == "grid":
            self.alpha = self._best_on_validation(silo)
        return self.mixed_model(silo.model, self.alpha)

    def report(self) -> dict[str, float]:
        return {"alpha": self.alpha}

    def local_state(self) -> dict[str, torch.Tensor]:
        if self.personal is None:
            return {}
        state = {f"{PREFIX}{k}": v for k, v in self.personal.state_dict().items()}
        return {**state, ALPHA: torch.tensor(self.alpha, dtype=torch.float64)}

    def load_local_state(self, silo: SiloTrainer, state: dict[str, torch.Tensor]) -> None:
        if not state:
            self.personal, self.alpha = None, self._initial_alpha()
            return
        self.alpha = float(state[ALPHA])
        self.personal = copy.deepcopy(silo.model)
        self.personal.load_state_dict(
            {k[len(PREFIX) :]: v for k, v in state.items() if k.startswith(PREFIX)}
        )
