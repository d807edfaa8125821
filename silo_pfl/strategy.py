"""The server's part of an algorithm: how a round's aggregate becomes the new global state.

The server checks every update, then takes the example-weighted mean of the accepted deltas and
of each named extra the algorithm's updates carry (SCAFFOLD's control-variate delta): an
`Aggregate`. Being a mean of sums, it is also what secure aggregation yields. The strategy turns
it into the new global keys, through the server optimizer (server.optimizer), and may keep state
of its own (control variates), checkpointed with the server and sent to the silos each round.

Strategies live here, not in their algorithm's file: the server process imports no torch, and an
algorithm's module does. The driver builds the strategy and hands it to the server
(`server.ServerStart`), so a plugin's strategy works too, at the cost of its module's imports.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from silo_pfl.aggregation import State
from silo_pfl.server_optimizers import ServerOptimizer

CONTROL_VARIATE = "control_variate"  # SCAFFOLD's extra


@dataclass(frozen=True)
class Aggregate:
    """A round's example-weighted means over the accepted updates."""

    delta: State  # of the global keys' deltas
    extras: dict[str, State]  # of each named extra, keyed like the global keys
    weight: float  # the accepted updates' training rows, summed (what the means divide by)
    total_weight: float  # every silo's training rows, summed: the whole federation's weight


class ServerStrategy:
    """The default: the server optimizer over the mean delta (sgd, lr 1: FedAvg's mean)."""

    # Names of the extras each silo's update carries, beside its delta.
    extras: ClassVar[tuple[str, ...]] = ()
    # Why this strategy cannot run under aggregation.secure, where the server sees only sums;
    # "" when it can (its inputs are the means above).
    secure_refusal: ClassVar[str] = ""

    def __init__(self, global_state: State) -> None:
        self.shapes = {k: v.shape for k, v in global_state.items()}

    def apply(self, state: State, aggregate: Aggregate, optimizer: ServerOptimizer) -> State:
        """The new global keys."""
        return optimizer.step(state, aggregate.delta)

    def broadcast(self) -> dict[str, State]:
        """What every silo receives with the global keys at the start of a round."""
        return {}

    def state_dict(self) -> dict[str, State]:
        """The strategy's own state, for the server's checkpoint."""
        return {}

    def load_state_dict(self, saved: dict[str, State]) -> None:
        """Restore what `state_dict` returned."""


class ControlVariates(ServerStrategy):
    """SCAFFOLD's server part (algorithms.scaffold): the server's control variate c, broadcast
    each round and moved by sum over the accepted silos of (n_i / n) Delta c_i, so that c stays
    the mean of the N silos' c_i weighted by their rows n_i (n: all N silos' rows) whichever
    silos take part. Karimireddy et al. (Alg. 1) weight the silos equally in both c and the
    model's step; here both weigh rows, as every aggregate does, so that the correction
    sum_i (n_i / n) (c - c_i) cancels in the row-weighted step and SCAFFOLD optimizes the same
    row-weighted objective as FedAvg. The mean of the Delta c_i times the accepted rows summed
    is that sum; under secure aggregation too, with no silo's rows known."""

    extras = (CONTROL_VARIATE,)

    def __init__(self, global_state: State) -> None:
        super().__init__(global_state)
        self.dtypes = {k: v.dtype for k, v in global_state.items()}
        self.c: State = {k: np.zeros(v.shape, np.float64) for k, v in global_state.items()}

    def apply(self, state: State, aggregate: Aggregate, optimizer: ServerOptimizer) -> State:
        for key, change in aggregate.extras[CONTROL_VARIATE].items():
            self.c[key] = self.c[key] + (aggregate.weight / aggregate.total_weight) * change
        return optimizer.step(state, aggregate.delta)

    def broadcast(self) -> dict[str, State]:
        return {CONTROL_VARIATE: {k: v.astype(self.dtypes[k]) for k, v in self.c.items()}}

    def state_dict(self) -> dict[str, State]:
        return {"c": dict(self.c)}

    def load_state_dict(self, saved: dict[str, State]) -> None:
        self.c = dict(saved["c"])
