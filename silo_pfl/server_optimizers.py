"""The server's optimizer over each round's mean update (Reddi et al., 2021, "Adaptive Federated
Optimization"): the mean delta is a pseudo-gradient step, and the server may scale it (sgd), add
momentum to it (momentum: FedAvgM, Hsu et al., 2019) or adapt it per coordinate (adam, yogi,
adagrad).

With Delta the round's example-weighted mean delta of one parameter:
  m = beta1 * m + (1 - beta1) * Delta
  v = v + Delta^2                                      (adagrad)
  v = beta2 * v + (1 - beta2) * Delta^2                (adam)
  v = v - (1 - beta2) * Delta^2 * sign(v - Delta^2)    (yogi)
  x = x + lr * m / (sqrt(v) + tau)
with m = 0 and v = tau^2 before the first round, and no bias correction, as in the paper. sgd is
x = x + lr * Delta: with lr = 1 it is FedAvg's mean, bit for bit. momentum is
  m = beta1 * m + Delta;  x = x + lr * m
with m = 0 before the first round (so its first round is sgd's). Only the model's parameters are
optimized; buffers (BatchNorm statistics) take the plain mean.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from silo_pfl.aggregation import State, apply_delta
from silo_pfl.config import ServerConfig
from silo_pfl.errors import ConfigError

OPTIMIZERS = ("sgd", "momentum", "adam", "yogi", "adagrad")
DEFAULT_LR = {"sgd": 1.0, "momentum": 1.0, "adam": 0.01, "yogi": 0.01, "adagrad": 0.01}


def resolve_server_optimizer(cfg: ServerConfig, own: str | None, algorithm: str) -> None:
    """Fill in server.optimizer (the algorithm's own, else sgd) and server.lr (its default)."""
    if cfg.optimizer is not None and cfg.optimizer not in OPTIMIZERS:
        raise ConfigError(
            f"server.optimizer: got {cfg.optimizer!r}, expected one of {', '.join(OPTIMIZERS)}"
        )
    if own is not None and cfg.optimizer not in (None, own):
        raise ConfigError(
            f"server.optimizer: got {cfg.optimizer}, but algorithm {algorithm} is fedavg with "
            f"server.optimizer={own}; use algorithm.name=fedavg server.optimizer={cfg.optimizer}"
        )
    cfg.optimizer = cfg.optimizer or own or "sgd"
    if cfg.lr is None:
        cfg.lr = DEFAULT_LR[cfg.optimizer]


class ServerOptimizer:
    """Turns the mean delta into the new global state; keeps m and v between rounds."""

    def __init__(self, cfg: ServerConfig, parameters: Iterable[str]) -> None:
        if cfg.optimizer not in OPTIMIZERS or cfg.lr is None:
            raise ValueError(f"server optimizer not resolved: {cfg.optimizer}, lr {cfg.lr}")
        self.kind, self.lr = cfg.optimizer, cfg.lr
        self.beta1, self.beta2, self.tau = cfg.beta1, cfg.beta2, cfg.tau
        self.parameters = frozenset(parameters)
        self.m: State = {}
        self.v: State = {}

    def step(self, state: State, delta: State) -> State:
        """The new global state from the current one and the round's mean delta."""
        if self.kind == "sgd":
            scale = self.parameters if self.lr != 1.0 else frozenset()  # lr 1: the mean itself
            scaled = {k: self.lr * d if k in scale else d for k, d in delta.items()}
            return apply_delta(state, scaled)
        step = {}
        for key, d in delta.items():
            if key not in self.parameters:
                step[key] = d
                continue
            d = np.asarray(d, dtype=np.float64)
            m = self.m.get(key, np.zeros_like(d))
            if self.kind == "momentum":
                self.m[key] = m = self.beta1 * m + d
                step[key] = self.lr * m
                continue
            v = self.v.get(key, np.full_like(d, self.tau**2))
            m = self.beta1 * m + (1 - self.beta1) * d
            square = d * d
            if self.kind == "adagrad":
                v = v + square
            elif self.kind == "adam":
                v = self.beta2 * v + (1 - self.beta2) * square
            else:
                v = v - (1 - self.beta2) * square * np.sign(v - square)
            self.m[key], self.v[key] = m, v
            step[key] = self.lr * m / (np.sqrt(v) + self.tau)
        return apply_delta(state, step)

    def state_dict(self) -> dict[str, State]:
        """m and v, for the server's checkpoint."""
        return {"m": dict(self.m), "v": dict(self.v)}

    def load_state_dict(self, saved: dict[str, State]) -> None:
        self.m, self.v = dict(saved["m"]), dict(saved["v"])
