"""Per-FedAvg (Fallah et al., 2020), first order: a global model trained so that a few gradient
steps on a silo's own data make a good personal model; each silo is judged by that adaptation.

Local training is first-order MAML, done by the optimizer of the shared loop (`FirstOrderMAML`):
the loop takes one batch per step, and the optimizer alternates an inner step on a batch D with
an outer step on the next batch D'. The silo's personalized model is a copy of the round's model
after `inner_steps` plain SGD steps of `inner_lr` on its training rows.

`inner_lr = 0` has no inner step: every batch is an outer step, the training and the model are
FedAvg's exactly, whatever `inner_steps`. `inner_steps = 0` judges the unadapted model.

`layerwise` is meta-learning with layer-wise personalization: the local layers (the head by
default) are the fast weights, and only they adapt: `inner_steps` SGD steps of `inner_lr` on the
silo's data each round, and again for the personalized model; they stay in the silo. The shared
layers are the slow weights, meta-learned by Reptile (Nichol et al., 2018): they train
`train.local_epochs` on the adapted head with the job's optimizer, to phi, and the silo sends
phi - w, so the server's weighted mean is Reptile's batched step w + mean(phi_i - w) with step
size 1 (a smaller step would be a server learning rate, the same for every algorithm).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from silo_pfl.algorithms import register
from silo_pfl.algorithms.base import Algorithm, Phase, SiloTrainer, require_at_least
from silo_pfl.errors import ConfigError
from silo_pfl.optim import SGD, Optimizer

ADAPT = "adapt"  # the purpose of the personalized model's adaptation


@dataclass
class PerFedAvgParams:
    """Per-FedAvg's options."""

    inner_steps: int = 5  # SGD steps adapting the personalized model (the fast weights)
    inner_lr: float = 0.01  # alpha: the inner step's size, in training and in adaptation
    layerwise: bool = False  # only the local layers adapt; the shared ones follow Reptile

    def validate(self) -> None:
        require_at_least("algorithm.perfedavg", self, 0, "inner_steps", "inner_lr")
        if self.layerwise and self.inner_steps < 1:
            raise ConfigError(
                f"algorithm.perfedavg.inner_steps: got {self.inner_steps}, expected >= 1 with "
                "layerwise=true (the local layers train only by the inner steps)"
            )
        if self.layerwise and self.inner_lr <= 0:
            raise ConfigError(
                f"algorithm.perfedavg.inner_lr: got {self.inner_lr}, expected > 0 with "
                "layerwise=true (the local layers train only by the inner steps)"
            )


class FirstOrderMAML(Optimizer):
    """First-order MAML over the shared loop's consecutive batches.

    The loop calls zero_grad, backward and step once per batch. The 1st, 3rd, ... step is an
    inner step: keep w, then w' = w - inner_lr * grad f(w; D). The next step is an outer step:
    its gradient is grad f(w'; D') on the next batch D'; w is put back and `outer` (the job's
    optimizer, over the same parameters) steps with that gradient. An inner step with no batch
    after it is undone by `finish`.
    """

    def __init__(self, params: list[nn.Parameter], inner_lr: float, outer: Optimizer) -> None:
        super().__init__(params)
        self.inner_lr, self.outer = inner_lr, outer
        self.saved: list[torch.Tensor] | None = None  # w during an inner step

    @torch.no_grad()
    def step(self) -> None:
        if self.saved is None:
            self.saved = [p.detach().clone() for p in self.params]
            for p in self.params:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-self.inner_lr)
        else:
            self._restore()
            self.outer.step()

    def finish(self) -> None:
        if self.saved is not None:
            self._restore()

    @torch.no_grad()
    def _restore(self) -> None:
        assert self.saved is not None
        for p, saved in zip(self.params, self.saved, strict=True):
            p.copy_(saved)
        self.saved = None


@register
class PerFedAvg(Algorithm):
    """FedAvg of first-order MAML updates; each silo is judged by a few adaptation steps."""

    name = "perfedavg"
    Params = PerFedAvgParams

    def local_rules(self) -> tuple[str, ...]:
        return ("head",) if self.params.layerwise else ()

    def trains_local_keys(self) -> bool:
        return self.params.layerwise

    def _adaptation(self) -> Phase:
        """`inner_steps` steps on the fast weights (an epoch gives at least one step)."""
        steps = self.params.inner_steps
        return Phase("local" if self.params.layerwise else "all", steps, steps=steps)

    def phases(self) -> list[Phase]:
        if self.params.layerwise:
            return [self._adaptation(), Phase("global", self.train.local_epochs)]
        return [Phase("all", self.train.local_epochs)]

    def optimizer(self, params: list[nn.Parameter], phase: Phase, purpose: str) -> Optimizer:
        inner_lr = self.params.inner_lr
        fast = purpose == ADAPT or (self.params.layerwise and phase.trainable == "local")
        if fast:
            return SGD(params, lr=inner_lr)
        outer = super().optimizer(params, phase, purpose)
        if self.params.layerwise or inner_lr == 0:
            return outer
        return FirstOrderMAML(params, inner_lr, outer)

    def personalized_model(self, silo: SiloTrainer, round_: int) -> nn.Module:
        if self.params.inner_steps == 0 or self.params.inner_lr == 0:
            return silo.model
        model = copy.deepcopy(silo.model)
        silo.train(model, self._adaptation(), round_, None, purpose=ADAPT)
        return model
