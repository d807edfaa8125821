"""Per-FedAvg (Fallah et al., 2020): a global model trained so that a few gradient steps on a
silo's own data make a good personal model; each silo is judged by that adaptation.

Local training is MAML, done by the optimizer of the shared loop, which takes one batch per step.
`variant=fo` (first order, `FirstOrderMAML`) alternates an inner step on a batch D with an outer
step on the next batch D'. `variant=hf` (Hessian-free, `HessianFreeMAML`) takes a third batch D''
and follows the MAML gradient (I - alpha * H(w; D'')) grad f(w'; D'), with the Hessian-vector
product from two more gradients of D'' (the loop's closure), as in the paper. The silo's
personalized model is a copy of the round's model after `inner_steps` plain SGD steps of
`inner_lr` on its training rows.

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
from silo_pfl.errors import ConfigError, FederationError
from silo_pfl.optim import SGD, Closure, Optimizer
from silo_pfl.unused_settings import Finding

ADAPT = "adapt"  # the purpose of the personalized model's adaptation
VARIANTS = ("fo", "hf")


@dataclass
class PerFedAvgParams:
    """Per-FedAvg's options."""

    inner_steps: int = 5  # SGD steps adapting the personalized model (the fast weights)
    inner_lr: float = 0.01  # alpha: the inner step's size, in training and in adaptation
    layerwise: bool = False  # only the local layers adapt; the shared ones follow Reptile
    variant: str = "fo"  # the meta-gradient: fo (first order) or hf (Hessian-free)
    hf_delta: float = 0.001  # delta of hf's Hessian-vector product by central differences

    def unused(self) -> list[Finding]:
        """Options the others make do nothing (silo_pfl.unused_settings)."""
        if self.inner_lr == 0:
            return [
                (
                    "inner_lr is 0",
                    ("inner_steps", "variant", "hf_delta"),
                    "there is no inner step, and the training and the model are FedAvg's",
                )
            ]
        if self.variant != "hf":
            return [(f"variant is {self.variant}", ("hf_delta",), "only variant=hf reads {it}")]
        return []

    def validate(self) -> None:
        require_at_least("algorithm.perfedavg", self, 0, "inner_steps", "inner_lr")
        if self.variant not in VARIANTS:
            raise ConfigError(
                f"algorithm.perfedavg.variant: got {self.variant!r}, expected one of "
                f"{', '.join(VARIANTS)}"
            )
        if not self.hf_delta > 0:
            raise ConfigError(f"algorithm.perfedavg.hf_delta: got {self.hf_delta}, expected > 0")
        if self.layerwise and self.variant != "fo":
            raise ConfigError(
                f"algorithm.perfedavg.variant: got {self.variant}, but layerwise=true meta-learns "
                "the shared layers by Reptile, which has no Hessian; use variant=fo with it"
            )
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
        self.saved: list[torch.Tensor] | None = None  # w, from the inner step on

    @torch.no_grad()
    def step(self, closure: Closure | None = None) -> None:
        if self.saved is None:
            self._inner_step()
        else:
            self._outer_step()

    def finish(self) -> None:
        if self.saved is not None:
            self._put_back()
        self.saved = None

    def _inner_step(self) -> None:
        """Keep w, then w' = w - inner_lr * the batch's gradient."""
        self.saved = [p.detach().clone() for p in self.params]
        for p in self.params:
            if p.grad is not None:
                p.add_(p.grad, alpha=-self.inner_lr)

    def _outer_step(self) -> None:
        """Put w back and let `outer` step from it with the gradients the parameters hold."""
        self._put_back()
        self.saved = None
        self.outer.step()

    @torch.no_grad()
    def _put_back(self) -> None:
        assert self.saved is not None
        for p, w in zip(self.params, self.saved, strict=True):
            p.copy_(w)


class HessianFreeMAML(FirstOrderMAML):
    """Per-FedAvg (HF) over the shared loop's consecutive batches D, D', D''.

    On D: keep w, then w' = w - alpha * grad f(w; D). On D': v = grad f(w'; D'), and w is put
    back. On D'': the loop's closure gives grad f(w + delta v; D'') and grad f(w - delta v; D''),
    their difference over 2 delta is H(w; D'') v, and `outer` (the job's optimizer) steps from w
    with v - alpha * H(w; D'') v. `finish` undoes a meta-step the loop's batches did not complete.
    """

    def __init__(
        self, params: list[nn.Parameter], inner_lr: float, delta: float, outer: Optimizer
    ) -> None:
        super().__init__(params, inner_lr, outer)
        self.delta = delta
        self.v: list[torch.Tensor | None] | None = None  # grad f(w'; D'), once taken

    @torch.no_grad()
    def step(self, closure: Closure | None = None) -> None:
        if self.saved is None:
            self._inner_step()
        elif self.v is None:
            self.v = [None if p.grad is None else p.grad.clone() for p in self.params]
            self._put_back()
        else:
            if closure is None:
                raise RuntimeError("HessianFreeMAML needs the loop's closure on its third batch")
            plus, minus = (
                self._gradient_at(closure, self.delta),
                self._gradient_at(closure, -self.delta),
            )
            for p, v, g_plus, g_minus in zip(self.params, self.v, plus, minus, strict=True):
                hvp = (
                    None
                    if g_plus is None or g_minus is None
                    else (g_plus - g_minus) / (2 * self.delta)
                )
                p.grad = None if v is None else (v if hvp is None else v - self.inner_lr * hvp)
            self.v = None
            self._outer_step()

    def finish(self) -> None:
        super().finish()
        self.v = None

    def _gradient_at(self, closure: Closure, scale: float) -> list[torch.Tensor | None]:
        """The closure's gradients at w + scale * v."""
        assert self.saved is not None and self.v is not None
        for p, w, v in zip(self.params, self.saved, self.v, strict=True):
            p.copy_(w if v is None else w + scale * v)
        with torch.enable_grad():
            closure()
        return [None if p.grad is None else p.grad.clone() for p in self.params]


@register
class PerFedAvg(Algorithm):
    """FedAvg of MAML updates (first order or Hessian-free); each silo is judged by a few
    adaptation steps."""

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

    def check_batches(self, silo: str, rows: int, per_epoch: int) -> None:
        """A meta-step takes two batches (three with variant=hf); a round with fewer would
        undo its inner step and send a zero update, weighted by the silo's rows, every round."""
        if self.params.layerwise or self.params.inner_lr == 0:
            return
        need = 3 if self.params.variant == "hf" else 2
        epochs, have = self.train.local_epochs, per_epoch * self.train.local_epochs
        if have < need:
            raise FederationError(
                f"silo {silo}: its {rows} training rows make {have} batch(es) a round "
                f"(train.batch_size={self.train.batch_size}, train.local_epochs={epochs}), but a "
                f"meta-step of perfedavg (variant={self.params.variant}) takes {need}, so it "
                "would train nothing; lower train.batch_size or raise train.local_epochs"
            )

    def optimizer(self, params: list[nn.Parameter], phase: Phase, purpose: str) -> Optimizer:
        inner_lr = self.params.inner_lr
        fast = purpose == ADAPT or (self.params.layerwise and phase.trainable == "local")
        if fast:
            return SGD(params, lr=inner_lr)
        outer = super().optimizer(params, phase, purpose)
        if self.params.layerwise or inner_lr == 0:
            return outer
        if self.params.variant == "hf":
            return HessianFreeMAML(params, inner_lr, self.params.hf_delta, outer)
        return FirstOrderMAML(params, inner_lr, outer)

    def personalized_model(self, silo: SiloTrainer, round_: int) -> nn.Module:
        if self.params.inner_steps == 0 or self.params.inner_lr == 0:
            return silo.model
        model = copy.deepcopy(silo.model)
        silo.train(model, self._adaptation(), round_, None, purpose=ADAPT)
        return model
