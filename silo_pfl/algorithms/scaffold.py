"""SCAFFOLD (Karimireddy et al., 2020), option II: control variates correct each silo's drift.

The server keeps a control variate c over the global keys and sends it each round; each silo
keeps its own c_i. Local SGD follows g - c_i + c instead of g (here: the linear loss term
<c - c_i, w>, whose gradient is exactly that correction). After K local steps of size lr the silo
sets c_i+ = c_i - c + (x - y) / (K * lr) and sends Delta c_i = c_i+ - c_i beside its delta; the
server adds sum_S (n_i / n) Delta c_i to c (strategy.ControlVariates), so c stays the mean of the
N silos' c_i weighted by their training rows n_i, whichever silos S take part: the weights of
the model's step, so that the correction cancels in it (the paper weighs silos equally in both).

With momentum m, K steps from a fresh buffer move lr * sum_{j=1..K} (1 - m^j) / (1 - m) per unit
of a steady gradient, so that takes the place of K * lr (`steps_moved`). Control variates of
buffers (BatchNorm statistics) stay zero.

The server has added Delta c_i once the update is aggregated, so c_i+ must outlive the silo's
process from then on, even if it dies before it commits the round (`server_mirrors_state`).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from silo_pfl.algorithms import register
from silo_pfl.algorithms.base import Algorithm, Phase, SiloTrainer
from silo_pfl.config import FederationConfig
from silo_pfl.errors import ConfigError
from silo_pfl.optim import Closure, Optimizer
from silo_pfl.strategy import CONTROL_VARIATE as EXTRA
from silo_pfl.strategy import ControlVariates
from silo_pfl.training import shared_tensors

PREFIX = "scaffold.c."


def steps_moved(steps: int, momentum: float) -> float:
    """How far `steps` steps of SGD (buf = m * buf + g; p -= lr * buf, from a fresh buffer) move
    the weights, in units of lr times a steady gradient: sum_{j=1..K} (1 - m^j) / (1 - m), which
    is K without momentum. Summed as sum_{i<K} (K - i) m^i, term by term: the closed form
    (K - m(1 - m^K)/(1 - m)) / (1 - m) cancels to nothing as m nears 1 (m = 1 - 1e-10: 10 for 55
    at K = 10)."""
    if momentum == 0:
        return float(steps)
    powers = np.arange(steps, dtype=np.float64)
    return float(np.sum((steps - powers) * momentum**powers))


class CountedSteps(Optimizer):
    """The job's optimizer, counting its steps into `scaffold.steps` (K of the c_i update)."""

    def __init__(self, inner: Optimizer, scaffold: Scaffold) -> None:
        super().__init__(inner.params)
        self.inner, self.scaffold = inner, scaffold

    def step(self, closure: Closure | None = None) -> None:
        self.inner.step(closure)
        self.scaffold.steps += 1

    def finish(self) -> None:
        self.inner.finish()


@register
class Scaffold(Algorithm):
    """FedAvg's local SGD, corrected by control variates; Delta c_i travels with the delta."""

    name = "scaffold"
    Strategy = ControlVariates
    server_mirrors_state = True

    def __init__(self, params, train) -> None:
        super().__init__(params, train)
        self.c_local: dict[str, torch.Tensor] = {}  # c_i, over the global keys
        self.correction: dict[str, torch.Tensor] = {}  # c - c_i, this round
        self.steps = 0

    def check_config(self, cfg: FederationConfig) -> None:
        super().check_config(cfg)
        if cfg.train.optimizer != "sgd":
            raise ConfigError(
                f"train.optimizer: got {cfg.train.optimizer}, but scaffold's control variates "
                "assume SGD steps; use train.optimizer=sgd"
            )

    def begin_round(
        self, silo: SiloTrainer, reference: dict[str, torch.Tensor], broadcast: dict
    ) -> None:
        server_c = broadcast[EXTRA]
        if not self.c_local:
            self.c_local = {k: torch.zeros_like(v) for k, v in reference.items()}
        floating = [k for k, v in reference.items() if v.is_floating_point()]
        server = shared_tensors({k: server_c[k] for k in floating})
        self.correction = {k: server[k] - self.c_local[k] for k in floating}
        self.steps = 0

    def optimizer(self, params: list[nn.Parameter], phase: Phase, purpose: str) -> Optimizer:
        return CountedSteps(super().optimizer(params, phase, purpose), self)

    def extra_loss(
        self, model: nn.Module, reference: dict[str, torch.Tensor]
    ) -> torch.Tensor | None:
        terms = [
            (param * self.correction[name]).sum()
            for name, param in model.named_parameters()
            if param.requires_grad and name in self.correction
        ]
        return torch.stack(terms).sum() if terms else None

    def update_extras(
        self, silo: SiloTrainer, reference: dict[str, torch.Tensor]
    ) -> dict[str, dict[str, np.ndarray]]:
        state = silo.model.state_dict()
        parameters = {name for name, _ in silo.model.named_parameters()}
        moved = self.train.lr * steps_moved(self.steps, self.train.momentum)
        change: dict[str, np.ndarray] = {}
        for key, old in self.c_local.items():
            new = old
            if key in parameters and key in self.correction and self.steps:
                # c_i+ = c_i - c + (x - y) / (K * lr), where c_i - c = -correction
                drift = (reference[key] - state[key]) / moved
                new = drift - self.correction[key]
            moved_c = new - old  # integer buffers' (BatchNorm's batch counters) stay zero
            change[key] = moved_c.numpy()
            self.c_local[key] = new
        return {EXTRA: change}

    def local_state(self) -> dict[str, torch.Tensor]:
        return {f"{PREFIX}{k}": v for k, v in self.c_local.items()}

    def load_local_state(self, silo: SiloTrainer, state: dict[str, torch.Tensor]) -> None:
        self.c_local = {k[len(PREFIX) :]: v.clone() for k, v in state.items()}
