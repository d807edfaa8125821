"""The server: holds the global keys, validates updates, aggregates them; never sees local keys."""

from __future__ import annotations

import io
import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from silo_pfl import checkpoint
from silo_pfl.aggregation import State, flatten, unflatten, weighted_mean
from silo_pfl.algorithms import build_algorithm
from silo_pfl.data import silo_names
from silo_pfl.messages import RoundReport, SiloUpdate
from silo_pfl.run_dir import server_dir
from silo_pfl.secure_aggregation import decode_mean, masked_sum, vector_length
from silo_pfl.server_optimizers import ServerOptimizer
from silo_pfl.settings import from_dict, split_rules
from silo_pfl.silo import init_model
from silo_pfl.split import compute_split
from silo_pfl.strategy import Aggregate

log = logging.getLogger("silo_pfl.server")


class Server:
    """Aggregates the silos' deltas of the global keys (and the named extras of their algorithm),
    weighted by their training examples; its algorithm's strategy and the server optimizer turn
    the means into the new global keys.

    Before aggregating it checks every update; one from a silo not enrolled, for another round,
    sent twice, not matching the global keys, not finite or over aggregation.max_update_norm is
    rejected, naming the silo and the reason, and the round goes on without it if the accepted
    ones still make a quorum (round.min_silos). Under aggregation.secure it receives only masked
    vectors and learns only their sum, so every enrolled silo must send one.
    """

    def __init__(
        self,
        config: dict[str, Any],
        input_shape: Sequence[int],
        num_classes: int,
        run_id: str = "default",
    ) -> None:
        self.cfg = from_dict(config)
        model = init_model(self.cfg, tuple(input_shape), num_classes)
        self.split = compute_split(model, split_rules(self.cfg))
        state = model.state_dict()
        self.state: State = {k: state[k].numpy().copy() for k in self.split.global_keys}
        self.strategy = build_algorithm(self.cfg.algorithm, self.cfg.train).server_strategy(
            self.state
        )
        parameters = {name for name, _ in model.named_parameters()} & set(self.state)
        self.optimizer = ServerOptimizer(self.cfg.server, parameters)
        # Every update's delta and extras, flattened: what is averaged (and masked, under secure).
        self.flat_shapes = {
            k: v.shape for k, v in flatten(self.state, self._extras_of(self.state)).items()
        }
        self.masked_shape = (vector_length(self.flat_shapes),)  # of every update under secure
        self.secure = self.cfg.aggregation.secure
        self.enrolled = frozenset(silo_names(self.cfg.data))
        # Config refuses a smaller quorum under secure aggregation, where every silo is needed.
        self.quorum = self.cfg.round.min_silos or len(self.enrolled)
        self.max_norm = self.cfg.aggregation.max_update_norm
        self.dir = server_dir(self.cfg, run_id)
        self.round = 0  # the last round aggregated

    def _extras_of(self, like: State) -> dict[str, State]:
        return {name: like for name in self.strategy.extras}

    def global_state(self) -> State:
        """The current global keys."""
        return self.state

    def broadcast(self) -> dict[str, State]:
        """What the strategy sends every silo with the global keys (SCAFFOLD's control variate)."""
        return self.strategy.broadcast()

    def _check_masked(self, update: SiloUpdate) -> None:
        """Under secure aggregation only a masked vector of the right length is accepted."""
        masked = update.masked
        if masked is None or update.delta or update.extras or update.num_examples:
            raise ValueError(
                f"update from silo {update.silo}: aggregation.secure is on, but the update is "
                "not masked"
            )
        if masked.dtype != np.uint64 or masked.shape != self.masked_shape:
            raise ValueError(
                f"update from silo {update.silo}: masked vector of {masked.dtype} "
                f"{masked.shape}, expected uint64 {self.masked_shape}"
            )

    def _check_sender(self, update: SiloUpdate, seen: set[str]) -> None:
        """The update comes from a silo of this federation, for this round, and only once."""
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

    def _check(self, update: SiloUpdate) -> None:
        if self.secure:
            self._check_masked(update)
            return
        if update.masked is not None:
            raise ValueError(
                f"update from silo {update.silo}: masked, but aggregation.secure is off"
            )
        if set(update.extras) != set(self.strategy.extras):
            raise ValueError(
                f"update from silo {update.silo}: extras {sorted(update.extras)}, expected "
                f"{sorted(self.strategy.extras)}"
            )
        self._check_values(update.silo, "", update.delta)
        for name, values in sorted(update.extras.items()):
            self._check_values(update.silo, f"{name}/", values)
        if update.num_examples < 1:
            raise ValueError(f"update from silo {update.silo}: num_examples must be >= 1")
        if self.max_norm is not None:
            norm = float(
                np.sqrt(sum(np.sum(np.square(v, dtype=np.float64)) for v in update.delta.values()))
            )
            if norm > self.max_norm:
                raise ValueError(
                    f"update from silo {update.silo}: norm {norm:.4g} exceeds "
                    f"aggregation.max_update_norm={self.max_norm:g}"
                )

    def _check_values(self, silo: str, prefix: str, values: dict[str, np.ndarray]) -> None:
        """Exactly the global keys, each of the global key's shape and dtype, and finite."""
        keys = set(values)
        expected = set(self.state)
        if keys != expected:
            extra = sorted(keys - expected)
            missing = sorted(expected - keys)
            raise ValueError(
                f"update from silo {silo}: unexpected keys {extra}, missing keys {missing}"
                + (f" in {prefix[:-1]}" if prefix else "")
            )
        for key, value in values.items():
            if np.shape(value) != self.state[key].shape:
                raise ValueError(
                    f"update from silo {silo}: {prefix}{key} has shape {np.shape(value)}"
                )
            if np.asarray(value).dtype != self.state[key].dtype:
                raise ValueError(
                    f"update from silo {silo}: {prefix}{key} is {np.asarray(value).dtype}, "
                    f"expected {self.state[key].dtype}"
                )
            if not np.all(np.isfinite(value)):
                raise ValueError(f"update from silo {silo}: {prefix}{key} is not finite")

    def aggregate(self, *updates: SiloUpdate) -> RoundReport:
        """Check every update, then, with a quorum, apply the example-weighted mean of the
        accepted deltas in silo-name order (deterministic). Without a quorum nothing changes."""
        round_ = self.round + 1
        accepted: list[SiloUpdate] = []
        rejected: dict[str, str] = {}
        for update in sorted(updates, key=lambda u: u.silo):
            try:
                self._check_sender(update, {u.silo for u in accepted})
                self._check(update)
            except ValueError as exc:
                log.warning("round %d: %s; rejected", round_, exc)
                rejected.setdefault(update.silo, str(exc))
                continue
            accepted.append(update)
        names = tuple(u.silo for u in accepted)
        missing = sorted(self.enrolled - set(names))
        if len(accepted) < self.quorum:
            why = "every silo under aggregation.secure" if self.secure else "round.min_silos"
            reason = (
                f"{len(accepted)} of {self.quorum} updates needed ({why}); none from "
                f"{', '.join(missing)}"
            )
            return RoundReport(round_, names, rejected, False, reason)
        self.round = round_
        unmasking = 0.0
        if self.state:
            if self.secure:
                began = time.perf_counter()
                mean = decode_mean(masked_sum([u.masked for u in accepted]), self.flat_shapes)
                unmasking = time.perf_counter() - began
            else:
                mean = weighted_mean(
                    [flatten(u.delta, u.extras) for u in accepted],
                    [u.num_examples for u in accepted],
                )
            delta, extras = unflatten(mean, self.strategy.extras)
            aggregate = Aggregate(delta, extras, len(accepted) / len(self.enrolled))
            self.state = self.strategy.apply(self.state, aggregate, self.optimizer)
        return RoundReport(round_, names, rejected, True, secure_seconds=unmasking)

    def checkpoint(self, round_: int, driver: dict[str, Any]) -> None:
        """Checkpoint, atomically, the global keys and the round, with the driver's part of the
        run's state (its selector, history, the MLflow run): all that resume needs."""
        if round_ != self.round:
            raise RuntimeError(f"server: checkpoint({round_}) after round {self.round}")
        saved = {
            "round": round_,
            "global": _tensors(self.state),
            "strategy": {k: _tensors(v) for k, v in self.strategy.state_dict().items()},
            "optimizer": {k: _tensors(v) for k, v in self.optimizer.state_dict().items()},
            "driver": driver,
        }
        checkpoint.save(self.dir, round_, saved)

    def resume(self) -> dict[str, Any]:
        """Load the newest good checkpoint; return the driver's part of it."""
        found = checkpoint.load_latest(self.dir)
        if found is None:
            raise checkpoint.CheckpointError(f"server: no good checkpoint in {self.dir}")
        round_, saved = found
        loaded = {k: v.numpy() for k, v in saved["global"].items()}
        if set(loaded) != set(self.state) or any(
            loaded[k].shape != self.state[k].shape for k in loaded
        ):
            raise checkpoint.CheckpointError(
                f"checkpoint {checkpoint.path_of(self.dir, round_)}: its global keys do not "
                "match this federation's model"
            )
        self.state, self.round = loaded, round_
        self.strategy.load_state_dict({k: _arrays(v) for k, v in saved["strategy"].items()})
        self.optimizer.load_state_dict({k: _arrays(v) for k, v in saved["optimizer"].items()})
        return saved["driver"]

    def state_bytes(self) -> bytes:
        """The global keys as the bytes of an .npz file: what the driver saves, on its own disk."""
        buffer = io.BytesIO()
        np.savez(buffer, **self.state)
        return buffer.getvalue()


def _tensors(state: State) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(np.array(v)) for k, v in state.items()}


def _arrays(state: dict[str, torch.Tensor]) -> State:
    return {k: v.numpy() for k, v in state.items()}
