"""SGD and Adam for the training loop, with torch.optim's update rules.

torch.optim.Optimizer imports torch._dynamo on first use, seconds of CPU in every fresh silo
process (docs/BENCHMARKS.md, "Cold start of a silo"). These two small classes do the same
arithmetic without it; tests check them against torch.optim.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator

import torch

# The loop's closure: the current batch's loss, with its gradients, at the parameters as they
# are now (torch.optim's convention). Only an optimizer that needs more than one gradient of a
# batch calls it (Per-FedAvg's Hessian-free step).
Closure = Callable[[], torch.Tensor]


class Optimizer(ABC):
    """Common part: the parameters and zero_grad."""

    def __init__(self, params: Iterable[torch.nn.Parameter]) -> None:
        self.params = list(params)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def _gradients(
        self, weight_decay: float
    ) -> Iterator[tuple[int, torch.nn.Parameter, torch.Tensor]]:
        """(index, parameter, gradient with L2 weight decay added) for parameters with a grad."""
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            yield i, p, p.grad.add(p, alpha=weight_decay) if weight_decay else p.grad

    @abstractmethod
    def step(self, closure: Closure | None = None) -> None:
        """Update the parameters from their gradients (`closure`: see Closure)."""

    def finish(self) -> None:
        """Called once after the loop's last step: an optimizer that leaves the parameters at a
        provisional point between two steps (a meta-learning inner step) puts them back."""
        return None


class SGD(Optimizer):
    """torch.optim.SGD without dampening or Nesterov: buf = m * buf + g; p -= lr * buf."""

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        lr: float,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(params)
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay
        self.buffers: dict[int, torch.Tensor] = {}

    @torch.no_grad()
    def step(self, closure: Closure | None = None) -> None:
        for i, p, grad in self._gradients(self.weight_decay):
            if self.momentum:
                buf = self.buffers.get(i)
                if buf is None:
                    buf = self.buffers[i] = grad.clone()
                else:
                    buf.mul_(self.momentum).add_(grad)
                grad = buf
            p.add_(grad, alpha=-self.lr)


class Adam(Optimizer):
    """torch.optim.Adam (L2 weight decay added to the gradient, no amsgrad)."""

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(params)
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.state: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.steps: dict[int, int] = {}

    @torch.no_grad()
    def step(self, closure: Closure | None = None) -> None:
        beta1, beta2 = self.betas
        for i, p, grad in self._gradients(self.weight_decay):
            if i not in self.state:
                self.state[i] = (torch.zeros_like(p), torch.zeros_like(p))
                self.steps[i] = 0
            exp_avg, exp_avg_sq = self.state[i]
            self.steps[i] += 1
            t = self.steps[i]
            exp_avg.lerp_(grad, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            bias1 = 1 - beta1**t
            bias2_sqrt = math.sqrt(1 - beta2**t)
            denom = (exp_avg_sq.sqrt() / bias2_sqrt).add_(self.eps)
            p.addcdiv_(exp_avg, denom, value=-self.lr / bias1)
