"""The server: holds the global keys, validates updates, aggregates them; never sees local keys."""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import numpy as np

from silo_pfl.aggregation import State, apply_delta, weighted_mean
from silo_pfl.config import from_dict
from silo_pfl.data import silo_names
from silo_pfl.messages import SiloUpdate
from silo_pfl.secure_aggregation import decode_mean, masked_sum, vector_length
from silo_pfl.silo import init_model, split_rules
from silo_pfl.split import compute_split


class Server:
    """Aggregates the silos' deltas of the global keys, weighted by their training examples.

    It refuses, naming the silo and the reason, an update from a silo not enrolled, for another
    round, sent twice, or not matching the global keys. Under aggregation.secure it receives only
    masked vectors and learns only their sum.
    """

    def __init__(
        self, config: dict[str, Any], input_shape: Sequence[int], num_classes: int
    ) -> None:
        self.cfg = from_dict(config)
        model = init_model(self.cfg, tuple(input_shape), num_classes)
        self.split = compute_split(model, split_rules(self.cfg))
        state = model.state_dict()
        self.state: State = {k: state[k].numpy().copy() for k in self.split.global_keys}
        self.shapes = {k: v.shape for k, v in self.state.items()}
        self.masked_shape = (vector_length(self.shapes),)  # of every update under secure
        self.secure = self.cfg.aggregation.secure
        self.enrolled = frozenset(silo_names(self.cfg.data))
        self.round = 0  # the last round aggregated

    def global_state(self) -> State:
        """The current global keys."""
        return self.state

    def _check_masked(self, update: SiloUpdate) -> None:
        """Under secure aggregation only a masked vector of the right length is accepted."""
        masked = update.masked
        if masked is None or update.delta or update.num_examples:
            raise ValueError(
                f"update from silo {update.silo}: aggregation.secure is on, but the update is "
                "not masked"
            )
        if masked.dtype != np.uint64 or masked.shape != self.masked_shape:
            raise ValueError(
                f"update from silo {update.silo}: masked vector of {masked.dtype} "
                f"{masked.shape}, expected uint64 {self.masked_shape}"
            )

    def _check_senders(self, updates: Sequence[SiloUpdate]) -> None:
        """Each update comes from a silo of this federation, for this round, and only once."""
        seen: set[str] = set()
        for update in updates:
            if update.silo not in self.enrolled:
                raise ValueError(
                    f"update from silo {update.silo}: not a silo of this federation (its silos "
                    f"are {', '.join(sorted(self.enrolled))})"
                )
            if update.round != self.round + 1:
                raise ValueError(
                    f"update from silo {update.silo}: for round {update.round}, but round "
                    f"{self.round + 1} is being aggregated"
                )
            if update.silo in seen:
                raise ValueError(f"update from silo {update.silo}: a second update this round")
            seen.add(update.silo)

    def _check(self, update: SiloUpdate) -> None:
        if self.secure:
            self._check_masked(update)
            return
        if update.masked is not None:
            raise ValueError(
                f"update from silo {update.silo}: masked, but aggregation.secure is off"
            )
        keys = set(update.delta)
        expected = set(self.state)
        if keys != expected:
            extra = sorted(keys - expected)
            missing = sorted(expected - keys)
            raise ValueError(
                f"update from silo {update.silo}: unexpected keys {extra}, missing keys {missing}"
            )
        for key, value in update.delta.items():
            if np.shape(value) != self.state[key].shape:
                raise ValueError(
                    f"update from silo {update.silo}: {key} has shape {np.shape(value)}"
                )
            if np.asarray(value).dtype != self.state[key].dtype:
                raise ValueError(
                    f"update from silo {update.silo}: {key} is {np.asarray(value).dtype}, "
                    f"expected {self.state[key].dtype}"
                )
            if not np.all(np.isfinite(value)):
                raise ValueError(f"update from silo {update.silo}: {key} is not finite")
        if update.num_examples < 1:
            raise ValueError(f"update from silo {update.silo}: num_examples must be >= 1")

    def aggregate(self, *updates: SiloUpdate) -> State:
        """Apply the example-weighted mean of the deltas, in silo-name order (deterministic)."""
        ordered = sorted(updates, key=lambda u: u.silo)
        self._check_senders(ordered)
        for update in ordered:
            self._check(update)
        self.round += 1
        if not self.state:
            return self.state
        if self.secure:
            mean = decode_mean(masked_sum([u.masked for u in ordered]), self.shapes)
        else:
            mean = weighted_mean([u.delta for u in ordered], [u.num_examples for u in ordered])
        self.state = apply_delta(self.state, mean)
        return self.state

    def state_bytes(self) -> bytes:
        """The global keys as the bytes of an .npz file: what the driver saves, on its own disk."""
        buffer = io.BytesIO()
        np.savez(buffer, **self.state)
        return buffer.getvalue()
