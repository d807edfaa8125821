"""Cold start on Ray: one silo joins a trained federation, on its own node.

The silo's actor loads its own data there and builds the federation's model and split. Each
round it runs its algorithm's local procedure with the global keys frozen at the trained
federation's (`Silo.adapt`), then, in the rounds eval.every evaluates, evaluates and commits,
and in the rounds between commits without evaluating, exactly as a founding silo does; its model
is selected on its validation rows. Beside it, unless told otherwise, a second actor on the
same node trains the same silo alone (algorithm `local`) for the same rounds: the baseline a silo
decides to join on. At the end the joining silo runs its exporters (its model is registered like
a founder's, tagged joined=onboard); the baseline's model is only reported.

An onboarding cannot be resumed: one that fails or is interrupted removes its directory and its
baseline's (on this node), as a fresh federation run that fails before its first checkpoint does.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any

import ray

from silo_pfl.callbacks import Callback
from silo_pfl.config import FederationConfig, to_dict
from silo_pfl.errors import FederationError
from silo_pfl.messages import EvalMetrics, FitMetrics, SiloInfo, SiloOutcome, SplitInfo
from silo_pfl.onboarding import onboard_report
from silo_pfl.results import FederationResult, RoundSummary, SiloResult
from silo_pfl.run_dir import ONBOARD_RUN, RESULT_FILE, RunDir, run_path
from silo_pfl.runtime.actors import get, start_silo, stop
from silo_pfl.runtime.aggregation_steps import ROUND_TIMEOUT
from silo_pfl.runtime.exporting import attach_exporters, check_own_stores, export
from silo_pfl.runtime.placement import (
    LABEL_WAIT_SECONDS,
    check_labels,
    check_local_cpus,
    silo_selector,
)
from silo_pfl.runtime.session import ray_session
from silo_pfl.selection import Selector, evaluated, never_finite
from silo_pfl.stop_signals import sigterm_interrupts_unless_set
from silo_pfl.tracking.registry import ONBOARD
from silo_pfl.tracking.trained_run import TrainedRun

log = logging.getLogger(__name__)
ALONE = "alone"  # the baseline's role, and the suffix of its directory's run id
JOINED = "joined"  # the joining silo's role (a silo may be named alone)


class Onboarding:
    """Runs one silo's cold start and returns a FederationResult with that one silo."""

    def __init__(
        self,
        cfg: FederationConfig,
        trained: TrainedRun,
        silo: str,
        callbacks: Sequence[Callback] = (),
        alone: FederationConfig | None = None,
    ) -> None:
        self.cfg, self.trained, self.silo = cfg, trained, silo
        self.callbacks = list(callbacks)
        self.alone = alone  # the baseline's config, or None for no baseline
        self.run_dir = RunDir.create(cfg, ONBOARD_RUN)
        alone_id = f"{self.run_dir.run_id}-{ALONE}"
        self.alone_dir = RunDir(alone_id, run_path(cfg, alone_id))  # made by its silo, if any

    def _emit(self, hook: str, *args: Any) -> None:
        for callback in self.callbacks:
            getattr(callback, hook)(*args)

    def _check_fit(self, info: SiloInfo) -> None:
        """The silo's data fits the trained model: same input shape, no class beyond it."""
        trained = self.trained
        if tuple(info.input_shape) != trained.input_shape:
            raise FederationError(
                f"silo {info.silo}: inputs of shape {tuple(info.input_shape)}, but the federation "
                f"of run {trained.run_id} was trained on {trained.input_shape}"
            )
        if trained.columns and info.columns != trained.columns:
            raise FederationError(
                f"silo {info.silo}: its data's columns differ from the founders' of run "
                f"{trained.run_id} in name or order; it needs the same columns, in the same order"
            )
        if info.num_classes > trained.num_classes:
            raise FederationError(
                f"silo {info.silo}: {info.num_classes} classes, but the federation of run "
                f"{trained.run_id} was trained on {trained.num_classes}"
            )

    def run(self) -> FederationResult:
        """Set up the joining silo (and its baseline), run the rounds, export, and return the
        result; on any failure, Ctrl-C included, neither directory is left behind."""
        try:
            return self._run()
        except BaseException:
            self.alone_dir.discard()  # first, so that the parents the run's own made empty out
            self.run_dir.discard()
            raise

    def _run(self) -> FederationResult:
        timeout = self.cfg.round.call_timeout_s
        run_id, name = self.run_dir.run_id, self.silo
        keep = ray.is_initialized()  # Ray outlives the run: its workers may serve the next one
        ended = False
        with ray_session(self.cfg.ray):
            start = time.perf_counter()
            check_labels({f"silo {name}": silo_selector(self.cfg, name)}, LABEL_WAIT_SECONDS)
            workers = 1 + (self.alone is not None)
            check_local_cpus(self.cfg, [[name]] * workers, ray.cluster_resources().get("CPU", 1))
            actors = {JOINED: start_silo(self.cfg, to_dict(self.cfg), name, run_id, keep=keep)}
            if self.alone is not None:
                actors[ALONE] = start_silo(
                    self.alone, to_dict(self.alone), name, self.alone_dir.run_id, keep=keep
                )
            try:
                roles = list(actors)
                infos = get([actors[r].setup.remote() for r in roles], "silo set-up", timeout)
                info = infos[0]
                self._check_fit(info)
                shape = (self.trained.input_shape, self.trained.num_classes)
                splits: list[SplitInfo] = get(
                    [actors[r].build.remote(*shape, None, r == JOINED) for r in roles],
                    "silo model",
                    timeout,
                )
                split = dataclasses.replace(splits[0], bytes_sent_per_round=0)  # sends nothing
                own = {name: actors[JOINED]}
                check_own_stores(self.callbacks, [info], own, timeout)
                self._emit("on_start", self.cfg, [info], split)
                exporting = attach_exporters(self.callbacks, [info], own, timeout)
                states = {JOINED: ray.put(self.trained.global_state), ALONE: ray.put({})}
                selectors = {role: Selector(self.cfg.eval.selection) for role in roles}
                self.unselected = {role: "" for role in roles}  # role -> why (not finite)
                history = []
                for round_ in range(1, self.cfg.rounds + 1):
                    self._emit("on_round_start", round_)
                    began = time.perf_counter()
                    evals = self._round(actors, states, selectors, round_)
                    fit, evaluation = evals[JOINED]
                    history.append(_summary(round_, began, fit, evaluation))
                    self._emit("on_round_end", history[-1])
                chosen, alone_none = self._selected_sides(roles)
                outcomes: list[SiloOutcome] = get(
                    [actors[r].outcome.remote() for r in chosen], "silo outcome", timeout
                )
                export(self.callbacks, list(exporting), own, timeout)
                ended = True
            finally:  # a failed onboarding's directories are deleted next
                stop(list(actors.values()), keep and ended, wait_gone=not ended)
            outcome = outcomes[0]
            result = FederationResult.of(
                self.cfg,
                self.run_dir,
                split,
                wall_seconds=time.perf_counter() - start,
                silos={name: SiloResult.of(info, outcome, bytes_sent_per_round=0, joined=ONBOARD)},
                history=history,
                extras={
                    "onboard": {
                        **onboard_report(
                            self.silo,
                            self.trained,
                            outcome,
                            outcomes[1] if len(outcomes) > 1 else None,
                        ),
                        **({"alone_none": alone_none} if alone_none else {}),
                    },
                    **{k: v for callback in self.callbacks for k, v in callback.extras().items()},
                },
            )
        with sigterm_interrupts_unless_set():  # Ray's session has ended: SIGTERM still stops
            self._emit("on_end", result)
            self._emit("on_closed")
            result.write_json(self.run_dir.path / RESULT_FILE)
        return result

    def _selected_sides(self, roles: list[str]) -> tuple[list[str], str]:
        """The sides with a model selected (none: every evaluated model of it was not finite),
        and why the alone baseline has none ("" if it has one). The joining silo must have one,
        else the onboarding ends in one line. The alone baseline is a comparison only: without
        one, a warning says why, and the silo joins without the comparison (`alone_none` in
        the report)."""
        if JOINED in self.unselected:
            algorithm = self.cfg.algorithm["name"]
            raise FederationError(
                never_finite(f"silo {self.silo}", self.unselected[JOINED], algorithm)
            )
        alone_none = ""
        if ALONE in self.unselected:
            alone_none = (
                f"silo {self.silo}'s alone baseline: its model was not finite in every round it "
                f"was evaluated ({self.unselected[ALONE]}), so the silo joined without that "
                "comparison; a lower train.lr or fewer train.local_epochs would give one"
            )
            log.warning("%s", alone_none)
        return [role for role in roles if role not in self.unselected], alone_none

    def _round(
        self,
        actors: dict[str, Any],
        states: dict[str, Any],
        selectors: dict[str, Selector],
        round_: int,
    ) -> dict[str, tuple[FitMetrics, EvalMetrics | None]]:
        """One round for the joining silo and its baseline side by side: adapt, then, in a
        round eval.every evaluates, evaluate, select on validation and commit; in a round
        between evaluations, commit without evaluating (the choice so far stands)."""
        timeout = self.cfg.round.timeout_s
        roles = list(actors)
        names = [f"silo {self.silo}" + ("" if r == JOINED else "'s alone baseline") for r in roles]
        state = [states[r] for r in roles]
        fits = get(
            [actors[r].adapt.remote(s, round_) for r, s in zip(roles, state, strict=True)],
            f"round {round_}: silo training",
            timeout,
            names,
            key=ROUND_TIMEOUT,
        )
        if not evaluated(round_, self.cfg.rounds, self.cfg.eval.every):
            commits = [actors[r].commit_unevaluated.remote(round_, None) for r in roles]
            get(commits, f"round {round_}: silo commit", timeout, names, key=ROUND_TIMEOUT)
            return {r: (f, None) for r, f in zip(roles, fits, strict=True)}
        evals = get(
            [actors[r].evaluate.remote(s, round_) for r, s in zip(roles, state, strict=True)],
            f"round {round_}: silo evaluation",
            timeout,
            names,
            key=ROUND_TIMEOUT,
        )
        keep = {r: bool(selectors[r].choose([e])) for r, e in zip(roles, evals, strict=True)}
        for role, e in zip(roles, evals, strict=True):
            if keep[role]:
                self.unselected.pop(role, None)
            elif role in self.unselected:
                self.unselected[role] = e.diverged
        commits = [actors[r].commit.remote(round_, keep[r]) for r in roles]
        get(commits, f"round {round_}: silo commit", timeout, names, key=ROUND_TIMEOUT)
        return {r: (f, e) for r, f, e in zip(roles, fits, evals, strict=True)}


def _summary(
    round_: int, began: float, fit: FitMetrics, evaluation: EvalMetrics | None
) -> RoundSummary:
    """The joining silo's round, in the shape of a federation round (it aggregates nothing);
    a round between evaluations (eval.every) has no accuracies."""
    figures = {"train_loss": fit.train_loss, "train_seconds": fit.train_seconds, "bytes_sent": 0.0}
    val = test = float("nan")
    if evaluation is not None:
        val, test = evaluation.val_accuracy, evaluation.test_accuracy
        figures.update(val_accuracy=val, test_accuracy=test)
    return RoundSummary(
        round=round_,
        seconds=time.perf_counter() - began,
        mean_train_loss=fit.train_loss,
        mean_val_accuracy=val,
        mean_test_accuracy=test,
        silos={fit.silo: figures},
        evaluated=evaluation is not None,
    )
