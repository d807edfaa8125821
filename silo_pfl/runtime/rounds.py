"""One federated round with a deadline, a quorum and retries; written once, for every algorithm.

An attempt: silos that died are first rejoined (restarted by Ray, they restore their own last
commit); every silo fits on the global state; the fits that arrive by the deadline
(round.timeout_s) go to the server, which rejects bad updates and aggregates if a quorum
(round.min_silos) is left; the silos whose updates were aggregated evaluate the new global state
and commit (checkpoint) the round in the same call, by the deadline. That call is sent with the
aggregation, to every silo that sent an update, and runs only for those the server's report
names as aggregated. Selection runs on their evaluations; its choice reaches each silo with its
next such call, or with `select` after the last round (`finish`). A round that is not evaluated
(`selection.evaluated`, eval.every) sends `commit_unevaluated` instead: the silos commit without
evaluating, and no selection runs. Without a quorum nothing is committed and the round is tried
again, up to round.retries times; every silo then starts again from its last commit.

Each step is one call per worker for all its silos (`call_many`), whose answers come back per
silo: a round costs the driver a few calls however many silos there are. Where the fit needs
nothing prepared (`steps.fits_alone`: updates in the clear), the next round's fits are sent with
the aggregation too, each queued behind its silo's evaluation on its worker, and run if the
round was aggregated: a worker goes from its evaluations straight into its next fits, while the
driver selects, the server checkpoints the round and the callbacks see it. So a worker has two
calls a round, and waits for the driver only for the server's sum. Where the fit needs its steps
prepared (secure aggregation's keys and shares), the next round's first attempt is prepared as
soon as the round was aggregated and its evaluations are in, and its fits are sent then, before
the driver ends the round; not when a silo has died, since it rejoins before a round is prepared
for it. A silo that dies or rejoins in between is sent a fit of its own after it rejoins, as
before. A silo still busy with a fit of a round before the last is sent no new one, which
would only queue behind it: the round waits for that fit's answer instead, as it would for
the new one's, and leaves the silo out.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray

from silo_pfl.config import FederationConfig
from silo_pfl.errors import FederationError, SiloLost, typed_line
from silo_pfl.messages import CallFailed, EvalMetrics, FitMetrics, RejoinInfo, RoundReport
from silo_pfl.results import RoundSummary
from silo_pfl.runtime.actors import (
    Shared,
    call_many,
    silos_in_call,
    task_error_cause,
    wait_each,
)
from silo_pfl.runtime.aggregation_steps import PlainSteps, Prepared, SecureSteps
from silo_pfl.runtime.metrics import DriverMetrics, NoMetrics
from silo_pfl.runtime.placement import homeless, silo_selector
from silo_pfl.selection import Selector, evaluated, never_finite

log = logging.getLogger("silo_pfl.rounds")
REJOIN_POLL_SECONDS = 0.5  # how often a restarting silo is asked again to rejoin
BUSY = "still busy with its fit of round"  # why a silo two rounds behind is sent no fit


@dataclass
class Party:
    """The driver's view of one silo: its actor, its last commit, its restarts."""

    name: str
    actor: Any
    committed: int = 0
    aggregated: tuple[int, int] | None = None  # the last (round, attempt) its update was in
    selected: int | None = None  # the round whose model selection chose for it (None: none yet)
    # Resumed from a checkpoint older than the driver's record of `selected`: the silo's own
    # checkpoint holds its choice, which a None here leaves in place.
    selected_by_silo: bool = False
    restarts: int = 0
    died: bool = False  # its process died: rejoin it before its next round
    # Why no model of it may be selected yet: its evaluated model that was not finite (the key),
    # and its last fit that diverged (the silo's reason); both "" after any other absence
    why_none: tuple[str, str] = ("", "")

    def diverged(self, algorithm: str) -> str:
        """The run's last line for this silo with no model selected, where divergence is why
        (more rounds would diverge again); "" where it is not."""
        evaluated, fitted = self.why_none
        if evaluated:
            later = f"; its last update was withheld too: {fitted}" if fitted else ""
            return never_finite(f"silo {self.name}", evaluated, algorithm) + later
        if fitted:
            return (
                f"silo {self.name}: left out of every evaluated round, it has no model to "
                f"select; its last update was withheld: {fitted}"
            )
        return ""

    @property
    def unselected(self) -> bool:
        """Whether no model of this silo has been selected yet."""
        return self.selected is None and not self.selected_by_silo

    def uncommitted(self) -> tuple[int, int] | None:
        """The (round, attempt) whose update was aggregated after its last commit, if any."""
        return self.aggregated if self.aggregated and self.aggregated[0] > self.committed else None


@dataclass
class Rejoin:
    """What a silo needs to set itself up again after a restart."""

    input_shape: tuple[int, ...]
    num_classes: int
    identity_keys: dict[str, bytes] = field(default_factory=dict)  # under aggregation.secure
    exporters: dict[str, dict[str, Any]] = field(default_factory=dict)  # silo -> its exporters


@dataclass
class Ahead:
    """A round's fits, sent before it began, with the previous round's aggregation (and, where
    the fit needs its steps prepared, what its first attempt was prepared with)."""

    round: int
    refs: dict[str, list[Any]]  # each silo's refs of its fit's two answers
    began: float = 0.0  # when the previous round ended: this round's start
    prepared: Prepared | None = None  # the first attempt's, prepared during the round before


def late_reason(timeout: float, key: str = "round.timeout_s") -> str:
    """Why a silo that did not answer by the deadline (`timeout` s, config key `key`) was left
    out."""
    return f"no answer within {key}={timeout:g} s"


def gather(
    refs: dict[str, Any],
    timeout: float,
    late: str | None = None,
    shares: dict[str, int] | None = None,
    start: float | None = None,
) -> tuple[dict[str, Any], dict[str, str], set[str]]:
    """Wait for every ref (or `Shared` item of a worker's answers) until `timeout` s from now
    (or from `start`, time.monotonic), for each silo: a worker answering for k silos of one call
    (packed), which it runs one after another, is waited for k times `timeout`; where each silo
    has a call of its own on its worker, `shares` gives that k (`actors.silos_in_call`).
    Returns the answers, a reason for each silo that failed or was late (`late`, else
    round.timeout_s's), and the silos whose process died: during the call, or before it (their
    restarted worker holds them no more: SiloLost)."""
    if not refs:
        return {}, {}, set()
    silos: dict[Any, int] = {}  # each object once, in order: how many silos it answers for
    for name, ref in refs.items():
        own = shares[name] if shares is not None else silos.get(_object(ref), 0) + 1
        silos[_object(ref)] = own
    ready = wait_each(silos, timeout, start)
    got = dict(zip(ready, _get_each(ready), strict=True))
    answers: dict[str, Any] = {}
    absent: dict[str, str] = {}
    died: set[str] = set()
    for name, ref in refs.items():
        if _object(ref) not in got:
            count = silos[_object(ref)]
            packed = f" (its worker's call for {count} silos: {count * timeout:g} s)"
            absent[name] = (late or late_reason(timeout)) + (packed if count > 1 else "")
            continue
        answer = got[_object(ref)]
        if isinstance(answer, ray.exceptions.RayTaskError):
            answer = task_error_cause(answer)
        elif isinstance(ref, Shared) and not isinstance(answer, ray.exceptions.RayActorError):
            answer = answer[ref.index]
        if isinstance(answer, ray.exceptions.RayActorError):
            died.add(name)
            absent[name] = f"its process died ({type(answer).__name__})"
        elif isinstance(answer, SiloLost) or (isinstance(answer, CallFailed) and answer.lost):
            died.add(name)
            absent[name] = "its process died before the call (its worker restarted)"
        elif isinstance(answer, CallFailed):
            absent[name] = f"failed: {answer.error}"
        elif isinstance(answer, BaseException):
            absent[name] = f"failed: {typed_line(answer)}"
        else:
            answers[name] = answer
    return answers, absent, died


def _object(ref: Any) -> Any:
    """The object `ref` is, or is an item of (`Shared`)."""
    return ref.ref if isinstance(ref, Shared) else ref


_FAILURES = (ray.exceptions.RayActorError, ray.exceptions.RayTaskError)


def _get_each(refs: list[Any]) -> list[Any]:
    """Each ready ref's value, or the actor's death or task error it raises instead: one call
    for them all (each call costs the driver, once per silo at every step), a call each only
    when one of them raises."""
    try:
        return ray.get(refs)
    except _FAILURES:
        values = []
        for ref in refs:
            try:
                values.append(ray.get(ref))
            except _FAILURES as exc:
                values.append(exc)
        return values


def _reasons(absent: dict[str, str]) -> str:
    """' (a, b: why; c: why)': the silos left out, grouped by reason."""
    by_reason: dict[str, list[str]] = {}
    for name, reason in sorted(absent.items()):
        by_reason.setdefault(reason, []).append(name)
    parts = [f"{', '.join(names)}: {reason}" for reason, names in by_reason.items()]
    return f" ({'; '.join(parts)})" if parts else ""


def _mean(values: list[float]) -> float:
    """Mean of the finite values; NaN when there are none."""
    finite = [v for v in values if np.isfinite(v)]
    return float(np.mean(finite)) if finite else float("nan")


class RoundRunner:
    """Runs rounds for the orchestrator; holds the parties and the selector between rounds."""

    def __init__(
        self,
        cfg: FederationConfig,
        server: Any,
        parties: dict[str, Party],
        rejoin: Rejoin,
        selector: Selector,
        metrics: DriverMetrics | None = None,
    ) -> None:
        self.cfg, self.server, self.parties = cfg, server, parties
        self.rejoin_args, self.selector = rejoin, selector
        self.timeout = cfg.round.timeout_s
        self.metrics = metrics or NoMetrics()
        # The server's global keys and broadcast as its last aggregation left them (refs).
        self.inputs: tuple[Any, Any] | None = None
        steps = SecureSteps if cfg.aggregation.secure else PlainSteps
        self.steps = steps(server, gather, self.timeout)
        self.ahead: Ahead | None = None  # the next round's fits, if already sent
        self.down: dict[str, str] = {}  # dead silos that cannot rejoin now, and why
        self.unjoined: dict[str, str] = {}  # dead silos whose last rejoin failed, and why
        # Each silo's fits sent and not known to have answered: (round, ref of its metrics).
        self.unanswered: dict[str, list[tuple[int, Any]]] = {}

    def run(self, round_: int) -> RoundSummary:
        """Run `round_` until an attempt has a quorum; fail, naming who was missing, if none."""
        ahead = self.ahead
        began = ahead.began if ahead is not None and ahead.round == round_ else time.perf_counter()
        failures = []
        for attempt in range(1, self.cfg.round.retries + 2):
            rejoined = self.rejoin_the_dead(round_)
            summary = self._attempt(round_, attempt, began, rejoined)
            if isinstance(summary, RoundSummary):
                alive = sum(not p.died for p in self.parties.values())
                self.metrics.round(round_, summary.seconds, alive)
                return summary
            failures.append(summary)
            log.warning("round %d, attempt %d: no quorum: %s", round_, attempt, summary)
        raise FederationError(
            f"round {round_}: no quorum after {len(failures)} attempts (round.retries="
            f"{self.cfg.round.retries}); last: {failures[-1]}"
        )

    def rejoin_the_dead(self, round_: int) -> dict[str, RejoinInfo]:
        """Each silo whose process died is restarted by Ray, then restores its last commit.
        Until Ray has it running again a call fails at once, so this asks again, bounded by
        round.call_timeout_s for each of its worker's silos that rejoin (packed, they rejoin one
        after another); a silo pinned to labels no live node carries is not waited for
        (`down` says why it stays out), and one whose rejoin failed is not asked again before
        the next attempt (`unjoined` says why)."""
        args = self.rejoin_args
        limit = self.cfg.round.call_timeout_s
        start = time.monotonic()
        late = late_reason(limit, "round.call_timeout_s")
        waiting = [n for n, p in self.parties.items() if p.died]
        shares = silos_in_call({n: self.parties[n].actor for n in waiting})
        rejoined: dict[str, RejoinInfo] = {}
        self.down, self.unjoined = {}, {}
        while waiting:
            waiting = [n for n in waiting if time.monotonic() < start + shares[n] * limit]
            if not waiting:
                break
            gone = homeless({n: silo_selector(self.cfg, n) for n in waiting})
            for name, reason in sorted(gone.items()):
                log.warning("round %d: silo %s cannot rejoin: %s", round_, name, reason)
            self.down.update(gone)
            waiting = [n for n in waiting if n not in gone]
            if not waiting:
                break
            refs = {
                n: self.parties[n].actor.rejoin.remote(
                    args.input_shape,
                    args.num_classes,
                    args.identity_keys,
                    self.parties[n].committed,
                    args.exporters.get(n, {}),
                    self.parties[n].uncommitted(),
                )
                for n in waiting
            }
            infos, absent, restarting = gather(refs, limit, late, shares, start)
            for name, info in infos.items():
                party = self.parties[name]
                party.died, party.restarts = False, party.restarts + 1
                party.committed = info.round
                rejoined[name] = info
                self.unanswered.pop(name, None)  # its restarted worker runs none of them
                log.warning(
                    "round %d: silo %s restarted (pid %d) and goes on from its round %d",
                    round_,
                    name,
                    info.pid,
                    info.round,
                )
            for name in set(absent) - restarting:
                log.warning("round %d: silo %s did not rejoin: %s", round_, name, absent[name])
                self.unjoined[name] = f"could not rejoin: {absent[name].removeprefix('failed: ')}"
            waiting = sorted(restarting)
            if waiting:
                time.sleep(REJOIN_POLL_SECONDS)
        return rejoined

    def _attempt(
        self, round_: int, attempt: int, began: float, rejoined: dict[str, RejoinInfo]
    ) -> RoundSummary | str:
        """One attempt at `round_`: its summary, or why it had no quorum."""
        live = {n: p.actor for n, p in self.parties.items() if not p.died}
        if self.inputs is None:
            self.inputs = (self.server.global_state.remote(), self.server.broadcast.remote())
        ahead = self._take_ahead(round_, attempt)
        if ahead is not None and ahead.prepared is not None:
            prepared = ahead.prepared
        else:
            prepared = self.steps.prepare(live, round_, attempt)
        self._mark_dead(prepared.died)
        if prepared.failure:
            return prepared.failure + _reasons(prepared.absent)
        fitting = {n: h for n, h in live.items() if prepared.inbox is None or n in prepared.inbox}
        # Fits sent ahead stand, except a rejoined silo's (its process died): it is sent its own.
        fit_refs = {
            n: r
            for n, r in (ahead.refs if ahead else {}).items()
            if n in fitting and n not in rejoined
        }
        # Every fitting silo's answered fits are forgotten (under secure aggregation all were
        # sent ahead); only those not sent one ahead may be found busy.
        busy = {n: r for n, r in self._busy(list(fitting), round_).items() if n not in fit_refs}
        rest = {n: h for n, h in fitting.items() if n not in fit_refs and n not in busy}
        if rest:
            fit_refs.update(self._fits(rest, round_, attempt, self.inputs, prepared.inbox))
        # A busy silo's last fit is waited for as its new one would be: the round keeps its pace.
        awaited = {n: self.unanswered[n][-1][1] for n in busy}
        metrics_refs = {n: m for n, (_, m) in fit_refs.items()}
        fits, absent, died = gather({**metrics_refs, **awaited}, self.timeout)
        for name in busy:
            fits.pop(name, None)
            if name not in died:
                absent[name] = busy[name]
        absent.update(prepared.absent)
        absent.update({n: self._why_not_running(n) for n in self.parties if n not in live})
        sent: dict[str, FitMetrics] = {}
        for name, metrics in fits.items():
            # A commit that answered late is the silo's last all the same: rejoin and resume
            # restore it, not an older round the silo may have pruned since.
            party = self.parties[name]
            party.committed = max(party.committed, metrics.committed)
            if metrics.withheld:
                absent[name] = metrics.withheld
                party.why_none = (party.why_none[0], metrics.withheld)
            else:
                sent[name] = metrics
        eval_refs: dict[str, list[Any]] = {}
        going_on = {n: h for n, h in live.items() if n not in died}

        evaluating = evaluated(round_, self.cfg.rounds, self.cfg.eval.every)

        def then(verdict: Any, inputs: tuple[Any, Any]) -> None:  # before the report is read
            selected = {n: self.parties[n].selected for n in sent}
            commit = ("evaluate_and_commit", inputs[0]) if evaluating else ("commit_unevaluated",)
            eval_refs.update(
                call_many(
                    {n: live[n] for n in sent},
                    *commit,
                    round_,
                    per_silo=selected,
                    after=verdict,
                    accepted_only=True,
                )
            )
            self._send_ahead(going_on, round_ + 1, inputs, verdict)

        updates = [fit_refs[n][0] for n in sent]
        aggregated = self.steps.aggregate(live, updates, round_, then if sent else None)
        report = aggregated.report
        self.inputs = aggregated.inputs
        died |= aggregated.died
        self._record_fits(fits, absent, died, report)
        absent.update(report.rejected)
        self._mark_dead(died)
        if not report.aggregated:
            return report.reason + _reasons(absent)
        for name in report.accepted:
            self.parties[name].aggregated = (round_, attempt)
        accepted = {n: eval_refs[n][0] for n in report.accepted}
        evals, late, died = gather(accepted, self.timeout)
        why = "its update was aggregated, but its evaluation and commit"
        absent.update({n: f"{why}: {r}" for n, r in late.items()})
        self._mark_dead(died)
        if not self.steps.fits_alone and not any(p.died for p in self.parties.values()):
            self._prepare_ahead(live, round_ + 1, aggregated.inputs)
        for name in evals:
            self.parties[name].committed = round_
        if evaluating:
            unselected = {n for n, p in self.parties.items() if p.unselected}
            for name in self.selector.choose([evals[n] for n in sorted(evals)], unselected):
                self.parties[name].selected = round_
        for name, reason in sorted(absent.items()):
            log.warning("round %d: silo %s left out: %s", round_, name, reason)
            if name in self.parties and not (name in fits and fits[name].withheld):
                self.parties[name].why_none = ("", "")  # late or lost: more rounds may do
        for name, e in sorted(evals.items()):
            if e is not None and e.diverged:
                self.parties[name].why_none = (e.diverged, "")
                why = f"its personalized model cannot be selected: {e.diverged}"
                log.warning("round %d: silo %s: %s", round_, name, why)
        summary = self._summary(
            round_, began, attempt, report, sent, evals, absent, rejoined, evaluating
        )
        if self.ahead is not None:
            self.ahead.began = time.perf_counter()
        return summary

    def _send_ahead(
        self, alive: dict[str, Any], round_: int, inputs: tuple[Any, Any], verdict: Any
    ) -> None:
        """Send `round_`'s first fits now, on the global keys and broadcast `inputs`, to the
        silos `alive`, if the fit needs nothing prepared and the run has that round. They run if
        `verdict` (the previous round's report's `Verdict`, or its ref) says it was aggregated."""
        if not self.steps.fits_alone or round_ > self.cfg.rounds:
            return
        busy = self._busy(list(alive), round_)
        free = {n: h for n, h in alive.items() if n not in busy}
        self.ahead = Ahead(round_, self._fits(free, round_, 1, inputs, after=verdict))

    def _prepare_ahead(self, alive: dict[str, Any], round_: int, inputs: tuple[Any, Any]) -> None:
        """Where a fit needs its steps prepared (secure aggregation's keys and shares): once the
        round before was aggregated and its evaluations are in, prepare `round_`'s first attempt
        now and send its fits, as `_send_ahead` does for fits that need nothing. A silo then
        goes from its evaluation into its next round's preparation and fit, not waiting for the
        driver's end of round (selection, the server's checkpoint, the callbacks). Only when
        every silo is alive: one that died rejoins before a round is prepared for it."""
        if round_ > self.cfg.rounds:
            return
        prepared = self.steps.prepare(alive, round_, 1)
        self._mark_dead(prepared.died)
        refs: dict[str, list[Any]] = {}
        if not prepared.failure and prepared.inbox is not None:
            fitting = {n: alive[n] for n in prepared.inbox}
            refs = self._fits(fitting, round_, 1, inputs, prepared.inbox)
        self.ahead = Ahead(round_, refs, prepared=prepared)

    def _fits(
        self,
        handles: dict[str, Any],
        round_: int,
        attempt: int,
        inputs: tuple[Any, Any],
        per_silo: dict[str, Any] | None = None,
        after: Any = None,
    ) -> dict[str, list[Any]]:
        """Send each silo of `handles` its fit of `round_`'s `attempt` on the global keys and
        broadcast `inputs` (with its own `per_silo` input, and after `after`, if given): the refs
        of its update and its metrics."""
        global_ref, broadcast_ref = inputs
        refs = call_many(
            handles,
            "fit",
            global_ref,
            round_,
            attempt,
            broadcast_ref,
            each=2,
            per_silo=per_silo,
            after=after,
        )
        for name, (_, metrics) in refs.items():
            self.unanswered.setdefault(name, []).append((round_, metrics))
        return refs

    def _busy(self, names: list[str], round_: int) -> dict[str, str]:
        """Of `names`, the silos still busy with a fit of a round before `round_ - 1`, and why:
        a fit of `round_` would only queue behind it (and hold that round's global keys in the
        object store), so none is sent. A fit of the round before may still end in time."""
        sent = {n: self.unanswered.get(n, []) for n in names}
        refs = list({_object(ref): None for fits in sent.values() for _, ref in fits})
        ready = set(ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)[0])
        busy: dict[str, str] = {}
        for name, fits in sent.items():
            left = [(r, ref) for r, ref in fits if _object(ref) not in ready]
            self.unanswered[name] = left
            oldest = min((r for r, _ in left), default=round_)
            if oldest < round_ - 1:
                busy[name] = f"{BUSY} {oldest}"
        return busy

    def finish(self) -> None:
        """After the last round: rejoin the silos that died, and give every silo the model
        selection chose for it, which it had not been told of (the last round's choice). A silo
        that dies as it is told is rejoined and told again, once."""
        never = sorted(n for n, p in self.parties.items() if p.unselected)
        why = [self.parties[n].diverged(self.cfg.algorithm["name"]) for n in never]
        if any(why):
            raise FederationError(next(line for line in why if line))
        if never:
            raise FederationError(
                f"silo {never[0]}: left out of every evaluated round, it has no model to select; "
                f"resume with more rounds (--resume rounds={self.cfg.rounds + 1} or more)"
            )
        chosen = {n: p.selected for n, p in self.parties.items()}
        for last in (False, True):
            self.rejoin_the_dead(self.cfg.rounds)
            if self.down:
                raise FederationError(
                    f"the final selection failed{_reasons(self.down)}; once such a node is "
                    "back, resume the run (--resume)"
                )
            actors = {n: self.parties[n].actor for n in chosen}
            refs = call_many(actors, "select", per_silo=chosen)
            limit = self.cfg.round.call_timeout_s
            late = late_reason(limit, "round.call_timeout_s")
            _, absent, died = gather({n: r for n, (r,) in refs.items()}, limit, late)
            self._mark_dead(died)
            if not absent or set(absent) != died or last:
                break
            chosen = {n: chosen[n] for n in died}
        absent.update({n: r for n, r in self.unjoined.items() if n in absent})
        if absent:
            raise FederationError(f"the final selection failed{_reasons(absent)}")

    def _take_ahead(self, round_: int, attempt: int) -> Ahead | None:
        """What was sent ahead for this round, if this is its first attempt; it is used once."""
        ahead, self.ahead = self.ahead, None
        if ahead is None or ahead.round != round_ or attempt != 1:
            return None
        return ahead

    def _record_fits(
        self,
        fits: dict[str, FitMetrics],
        absent: dict[str, str],
        died: set[str],
        report: RoundReport,
    ) -> None:
        """Live metrics of an attempt's fits: the straggler among those that arrived, and why
        each update left out was (late, died, failed, withheld, rejected, down)."""
        self.metrics.fits({n: m.train_seconds for n, m in fits.items()})
        late = late_reason(self.timeout)
        why = {n: "withheld" for n, m in fits.items() if m.withheld}
        for name, reason in absent.items():
            if name in why:
                continue
            if name in died:
                why[name] = "died"
            elif reason.startswith((late, BUSY)):  # a packed worker's: with its call's time
                why[name] = "late"
            else:  # not running since an earlier death, or its fit raised
                why[name] = "down" if self.parties[name].died else "failed"
        why.update({n: "rejected" for n in report.rejected})
        self.metrics.left_out(why)

    def _why_not_running(self, name: str) -> str:
        """Why dead silo `name` was not running for an attempt."""
        return self.down.get(name) or self.unjoined.get(name, "not running (restart pending)")

    def _mark_dead(self, names: set[str]) -> None:
        for name in names:
            self.parties[name].died = True

    def _summary(
        self,
        round_: int,
        began: float,
        attempt: int,
        report: RoundReport,
        fits: dict[str, FitMetrics],
        evals: dict[str, EvalMetrics | None],
        absent: dict[str, str],
        rejoined: dict[str, RejoinInfo],
        evaluating: bool,
    ) -> RoundSummary:
        """The round as the driver saw it; where it was not `evaluating` (eval.every), `evals`
        holds None for each silo that committed it. Each silo that sent an update has its fit's
        figures, aggregated or not (an update the server rejected crossed the wire all the
        same); the means are over the silos that committed the round."""
        per_silo: dict[str, dict[str, float]] = {}
        for name, fit in sorted(fits.items()):
            per_silo[name] = {
                "train_loss": fit.train_loss,
                "train_seconds": fit.train_seconds,
                "bytes_sent": float(fit.bytes_sent),
            }
        for name, e in evals.items():
            if e is not None:
                per_silo[name].update(val_accuracy=e.val_accuracy, test_accuracy=e.test_accuracy)
        scored = [e for e in evals.values() if e is not None]
        return RoundSummary(
            round=round_,
            seconds=time.perf_counter() - began,
            mean_train_loss=_mean([fits[n].train_loss for n in evals]),
            mean_val_accuracy=_mean([e.val_accuracy for e in scored]),
            mean_test_accuracy=_mean([e.test_accuracy for e in scored]),
            silos=per_silo,
            participants=list(report.accepted),
            absent=dict(sorted(absent.items())),
            attempts=attempt,
            restarted={n: dataclasses.asdict(i) for n, i in rejoined.items()},
            evaluated=evaluating,
        )
