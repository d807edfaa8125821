"""The server: holds the global keys, validates updates, aggregates them; never sees local keys."""

from __future__ import annotations

import io
import logging
import time
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from silo_pfl import checkpoint, durable, run_lock
from silo_pfl.aggregation import State, flatten, unflatten, weighted_mean
from silo_pfl.config import merge_config
from silo_pfl.messages import RoundReport, SiloUpdate
from silo_pfl.round_log import RoundLog
from silo_pfl.run_dir import server_dir
from silo_pfl.secure.aggregator import SecureAggregator, SecureRoundError
from silo_pfl.secure.fixed_point import decode_mean, decoded_weight, vector_length
from silo_pfl.secure.identity import configured_keys
from silo_pfl.secure.messages import Advertisement, Reveal, SealedShares
from silo_pfl.secure.params import secure_params
from silo_pfl.server_optimizers import ServerOptimizer
from silo_pfl.strategy import Aggregate, ServerStrategy

log = logging.getLogger("silo_pfl.server")


@dataclass(frozen=True)
class ServerStart:
    """What the server starts from, built where torch is (`server_start.server_start`)."""

    state: State  # the initial global keys
    parameters: frozenset[str]  # which of them are parameters (the server optimizer's to step)
    strategy: ServerStrategy  # the algorithm's server part, over `state`
    silos: tuple[str, ...]  # the federation's silos
    total_rows: int  # their training rows, summed (the federation's weight; no silo's own)


class Server:
    """Aggregates the silos' deltas of the global keys (and the named extras of their algorithm),
    weighted by their training examples; its algorithm's strategy and the server optimizer turn
    the means into the new global keys.

    Before aggregating it checks every update; one from a silo not enrolled, for another round,
    sent twice, not matching the global keys, not finite or over aggregation.max_update_norm is
    rejected, naming the silo and the reason, and the round goes on without it if the accepted
    ones still make a quorum (round.min_silos). Under aggregation.secure it runs the server's
    side of the protocol (`SecureAggregator`): it receives only masked vectors, and learns only
    the sum of the survivors' updates, once they have revealed the shares that unmask it.

    It needs no torch: its model's initial global keys and its strategy come in `start`, and
    its checkpoints are numpy's (`checkpoint.save_arrays`).
    """

    def __init__(self, config: dict[str, Any], start: ServerStart, run_id: str = "default") -> None:
        self.cfg = merge_config(config)  # validated by the driver; no registry is needed here
        self.state: State = dict(start.state)
        self.strategy = start.strategy
        self.optimizer = ServerOptimizer(self.cfg.server, set(start.parameters))
        # Every update's delta and extras, flattened: what is averaged (and masked, under secure).
        self.flat_shapes = {
            k: v.shape for k, v in flatten(self.state, self._extras_of(self.state)).items()
        }
        self.masked_shape = (vector_length(self.flat_shapes),)  # of every update under secure
        names = list(start.silos)
        self.enrolled = frozenset(names)
        self.total_rows = start.total_rows
        self.protocol: SecureAggregator | None = None
        self.quorum = self.cfg.round.min_silos or len(self.enrolled)
        if self.cfg.aggregation.secure:
            params = secure_params(self.cfg, names)
            self.protocol = SecureAggregator(params, configured_keys(self.cfg, names))
            self.quorum = self.cfg.round.min_silos or params.threshold
        # Under secure: the accepted masked vectors awaiting their reveals, and the rejected.
        self._pending: tuple[int, dict[str, np.ndarray], dict[str, str]] | None = None
        # What the norm bounds measure: every float key, not integer counters (BatchNorm's
        # num_batches_tracked, a silo's local steps, would outweigh the rest).
        self.measured = frozenset(k for k, v in self.state.items() if v.dtype.kind == "f")
        self.dir = server_dir(self.cfg, run_id)
        run_lock.hold(self.dir, run_id)  # one driver at a time runs this run
        self._release = weakref.finalize(self, run_lock.release, self.dir)  # once, however it ends
        self.history = RoundLog(self.dir)  # the driver's round summaries
        self.round = 0  # the last round aggregated

    def release(self) -> None:
        """The run is over for this server: another may serve it (a later --resume)."""
        self._release()

    def _extras_of(self, like: State) -> dict[str, State]:
        return {name: like for name in self.strategy.extras}

    def global_state(self) -> State:
        """The current global keys."""
        return self.state

    def broadcast(self) -> dict[str, State]:
        """What the strategy sends every silo with the global keys (SCAFFOLD's control variate)."""
        return self.strategy.broadcast()

    def _secure(self) -> SecureAggregator:
        if self.protocol is None:
            raise RuntimeError("server: aggregation.secure is off")
        return self.protocol

    def enroll(self, round_: int, attempt: int, adverts: list[Advertisement]) -> None:
        """Secure aggregation, step 1: the attempt's enrolled silos, whose signed keys came."""
        self._secure().enroll(round_, attempt, adverts)

    def route(self, bundles: list[SealedShares]) -> dict[str, dict[str, bytes]]:
        """Secure aggregation, step 2: each silo's inbox of sealed shares; fixes who masks."""
        return self._secure().route(bundles)

    def _check_masked(self, update: SiloUpdate) -> None:
        """Under secure aggregation only a masked vector of the right length is accepted, from
        a silo that shared keys in this round's attempt."""
        self._secure().check(update.silo, update.round, update.attempt)
        masked = update.masked
        if masked is None or update.delta or update.extras or update.num_examples:
            raise ValueError(
                f"update from silo {update.silo}: aggregation.secure is on, but the update is "
                "not masked"
            )
        pairing = update.pairing
        if pairing is None or (pairing.silo, pairing.round, pairing.attempt) != (
            update.silo,
            update.round,
            update.attempt,
        ):
            raise ValueError(f"update from silo {update.silo}: masked without its signed pairing")
        if not self._secure().signed(pairing):
            raise ValueError(
                f"update from silo {update.silo}: its pairing is not signed by its identity key"
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
        if self.protocol is not None:
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
        aggregation = self.cfg.aggregation
        if aggregation.max_update_norm is not None:
            self._check_norm(update.silo, "", update.delta, "max_update_norm")
        if aggregation.max_extra_norm is not None:
            for name, values in sorted(update.extras.items()):
                self._check_norm(update.silo, f"{name} ", values, "max_extra_norm")

    def _check_norm(
        self, silo: str, part: str, values: dict[str, np.ndarray], setting: str
    ) -> None:
        """The L2 norm of one part of an update (its delta, or an extra such as SCAFFOLD's
        control-variate change, which reaches every silo through the server's state) over its
        float values, at most aggregation.<setting>."""
        bound = getattr(self.cfg.aggregation, setting)
        squares = (
            np.sum(np.square(v, dtype=np.float64)) for k, v in values.items() if k in self.measured
        )
        norm = float(np.sqrt(sum(squares)))
        if norm > bound:
            raise ValueError(
                f"update from silo {silo}: {part}norm {norm:.4g} exceeds "
                f"aggregation.{setting}={bound:g}"
            )

    def _check_values(self, silo: str, prefix: str, values: dict[str, np.ndarray]) -> None:
        """Exactly the global keys, each of the global key's shape and dtype (whether they are
        finite is checked on the mean, `_finite_mean`)."""
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
        mean = None
        if self.protocol is None and accepted:
            mean, accepted = self._finite_mean(round_, accepted, rejected)
        names = tuple(u.silo for u in accepted)
        missing = sorted(self.enrolled - set(names))
        if len(accepted) < self.quorum:
            why = "aggregation.secure_threshold" if self.protocol else "round.min_silos"
            reason = (
                f"{len(accepted)} updates, {self.quorum} needed ({why}); none from "
                f"{', '.join(missing)}"
            )
            return RoundReport(round_, names, rejected, False, reason)
        if self.protocol is not None:
            pairings = {u.silo: u.pairing for u in accepted if u.pairing is not None}
            try:
                request = self.protocol.unmask_request(names, pairings)
            except SecureRoundError as exc:
                log.warning("%s", exc)
                return RoundReport(round_, names, rejected, False, str(exc))
            self._pending = (round_, {u.silo: u.masked for u in accepted}, rejected)
            return RoundReport(round_, names, rejected, False, "awaiting the reveals", request)
        assert mean is not None  # a quorum of accepted plain updates has a mean
        weight = float(sum(u.num_examples for u in accepted))
        return self._apply(round_, names, rejected, mean, weight)

    def _finite_mean(
        self, round_: int, accepted: list[SiloUpdate], rejected: dict[str, str]
    ) -> tuple[State | None, list[SiloUpdate]]:
        """The accepted updates' weighted mean, and the updates it is of. An infinity or NaN in
        any update makes the mean non-finite, so only then is each update read again; those with
        one are rejected, naming the key, and the mean is taken again without them."""
        mean = _mean(accepted)
        if _finite(mean):
            return mean, accepted
        finite = []
        for update in accepted:
            bad = [
                k for k, v in flatten(update.delta, update.extras).items() if not _finite({k: v})
            ]
            if bad:
                reason = f"update from silo {update.silo}: {bad[0]} is not finite"
                log.warning("round %d: %s; rejected", round_, reason)
                rejected[update.silo] = reason
            else:
                finite.append(update)
        if len(finite) == len(accepted):  # every update finite: the mean overflowed; it stands
            return mean, accepted
        return (_mean(finite) if finite else None), finite

    def unmask(self, *reveals: Reveal) -> RoundReport:
        """Secure aggregation, step 4: remove the masks from the pending round's sum with the
        survivors' reveals, and apply its mean; with too few shares, nothing changes."""
        if self._pending is None:
            raise RuntimeError("server: unmask() without a pending secure round")
        round_, vectors, rejected = self._pending
        self._pending = None
        names = tuple(sorted(vectors))
        began = time.perf_counter()
        try:
            total = self._secure().unmask(vectors, list(reveals))
        except SecureRoundError as exc:
            log.warning("%s", exc)
            return RoundReport(round_, names, rejected, False, str(exc))
        mean = decode_mean(total, self.flat_shapes)
        weight = decoded_weight(total)
        return self._apply(round_, names, rejected, mean, weight, time.perf_counter() - began)

    def _apply(
        self,
        round_: int,
        names: tuple[str, ...],
        rejected: dict[str, str],
        mean: State,
        weight: float,
        secure_seconds: float = 0.0,
    ) -> RoundReport:
        """The round's mean update (of updates whose training rows sum to `weight`), through
        the strategy and the server optimizer."""
        self.round = round_
        if self.state:
            delta, extras = unflatten(mean, self.strategy.extras)
            aggregate = Aggregate(delta, extras, weight, self.total_rows)
            self.state = self.strategy.apply(self.state, aggregate, self.optimizer)
        return RoundReport(round_, names, rejected, True, secure_seconds=secure_seconds)

    def checkpoint(self, round_: int, driver: dict[str, Any]) -> None:
        """Checkpoint, atomically, the global keys and the round, with the driver's part of the
        run's state (its selector, the MLflow run): all that resume needs. The driver's
        `summary` of this round, if it sends one, goes to the round log (`round_log`), which
        holds the history; the checkpoint records how many rounds the log then held."""
        if round_ != self.round:
            raise RuntimeError(f"server: checkpoint({round_}) after round {self.round}")
        with durable.durable_together():  # one sync of its file system, not five fsyncs
            if driver.get("summary") is not None:
                self.history.append(round_, driver["summary"])
            saved = {
                "round": round_,
                "global": self.state,
                "strategy": self.strategy.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "driver": {k: v for k, v in driver.items() if k != "summary"},
                "logged": self.history.rounds,
            }
            checkpoint.save_arrays(self.dir, round_, saved, _one_selected(driver))

    def resume(self, before: int | None = None) -> dict[str, Any]:
        """Load the newest good checkpoint (of a round before `before`, if given: a silo's of
        a newer round is damaged); return the driver's part of it, with the history of the
        rounds it covers and a line for each newer checkpoint skipped as partial or corrupted
        ("skipped")."""
        skipped: list[str] = []
        while True:
            found = checkpoint.load_latest(self.dir, skipped, before)
            if found is None:
                older = "" if before is None else f" before round {before}"
                last = f" (last: {skipped[-1]})" if skipped else ""
                raise checkpoint.CheckpointError(
                    f"server: no good checkpoint{older} in {self.dir}{last}"
                )
            round_, saved = found
            loaded = _arrays(saved["global"])
            if set(loaded) != set(self.state) or any(
                loaded[k].shape != self.state[k].shape for k in loaded
            ):
                raise checkpoint.CheckpointError(
                    f"checkpoint {checkpoint.path_of(self.dir, round_)}: its global keys do not "
                    "match this federation's model"
                )
            driver = {**saved["driver"], "skipped": skipped}
            if "history" in driver:  # a checkpoint from before the round log held the history
                self.history.rewrite(driver["history"])
                break
            try:  # a log without this checkpoint's rounds (lost in a power cut): an older one
                driver["history"] = self.history.read(saved["logged"])
                break
            except checkpoint.CheckpointError as exc:
                skipped.append(f"{exc}; checkpoint {checkpoint.path_of(self.dir, round_)} skipped")
                before = round_
        self.state, self.round = loaded, round_
        self.strategy.load_state_dict({k: _arrays(v) for k, v in saved["strategy"].items()})
        self.optimizer.load_state_dict({k: _arrays(v) for k, v in saved["optimizer"].items()})
        return driver

    def state_bytes(self, round_: int | None = None) -> bytes:
        """The global keys as the bytes of an .npz file: what the driver saves, on its own disk.
        Those of round `round_` if given (the round every silo selected, whose checkpoint is
        kept for it), else the last round's: also where that checkpoint is gone (pruned by a
        version that did not keep it, before a resume), which is said."""
        state = self.state
        if round_ is not None and round_ != self.round:
            try:
                state = _arrays(checkpoint.load(self.dir, round_)["global"])
            except checkpoint.CheckpointError as exc:
                log.warning("%s; the run keeps the last round's global keys instead", exc)
        buffer = io.BytesIO()
        np.savez(buffer, **state)
        return buffer.getvalue()


def _one_selected(driver: dict[str, Any]) -> int | None:
    """The round whose model every silo has selected (eval.selection best_mean_val or last),
    whose checkpoint is kept for its global keys; None where they differ (best_val) or none is
    selected yet."""
    rounds = set(driver.get("selected", {}).values())
    return int(next(iter(rounds))) if len(rounds) == 1 and None not in rounds else None


def _mean(updates: list[SiloUpdate]) -> State:
    """The example-weighted mean of the updates' deltas and extras, flattened, in their order."""
    return weighted_mean(
        [flatten(u.delta, u.extras) for u in updates], [u.num_examples for u in updates]
    )


def _finite(values: State) -> bool:
    return all(bool(np.isfinite(v).all()) for v in values.values())


def _arrays(values: dict[str, Any]) -> State:
    """Arrays as a checkpoint holds them; one written before the server stopped importing torch
    holds tensors (`checkpoint.load` imports torch to read it)."""
    return {k: v.numpy() if hasattr(v, "numpy") else v for k, v in values.items()}
