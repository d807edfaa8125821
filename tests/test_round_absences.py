"""The driver's round bookkeeping (runtime.rounds): each reason a silo is left out names the
setting or failure that put it out, and a silo still busy with an old fit is sent no more."""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import ray

from silo_pfl.callbacks import Callback
from silo_pfl.errors import FederationError
from silo_pfl.federation import Federation
from silo_pfl.runtime import rounds
from silo_pfl.runtime.rounds import Party, Rejoin, RoundRunner
from silo_pfl.selection import Selector


def test_a_final_selection_that_times_out_names_round_call_timeout_s(job, ray_local, monkeypatch):
    cfg = job("jobs/heart_disease.yaml", "round.timeout_s=15", "round.call_timeout_s=0.5")
    never = ray.remote(resources={"nowhere": 1})(lambda: None).remote()  # never scheduled
    monkeypatch.setattr(
        rounds, "call_many", lambda actors, method, per_silo: {n: (never,) for n in actors}
    )
    parties = {"va": Party("va", actor=None, selected=1)}
    runner = RoundRunner(cfg, None, parties, Rejoin((13,), 2), Selector("last"))
    try:
        with pytest.raises(FederationError) as failed:
            runner.finish()
    finally:
        ray.cancel(never)
    assert "va: no answer within round.call_timeout_s=0.5 s" in str(failed.value)
    assert "round.timeout_s" not in str(failed.value)


class LoseSilo(Callback):
    """After round 1, silo va loses its directory and its process; keeps every round's summary."""

    def __init__(self) -> None:
        self.history = []

    def on_start(self, config, silos, split) -> None:
        self.pid = next(info.pid for info in silos if info.silo == "va")
        self.runs = Path(config.output_dir) / config.name

    def on_round_end(self, summary) -> None:
        self.history.append(summary)
        if summary.round == 1:
            for directory in self.runs.glob("*/silos/va"):
                shutil.rmtree(directory)
            os.kill(self.pid, signal.SIGKILL)
            time.sleep(1)


def test_a_failed_rejoin_is_reported_with_its_reason(job, ray_local):
    lose = LoseSilo()
    cfg = job(
        "jobs/heart_disease.yaml",
        "rounds=3",
        "round.min_silos=3",
        "ray.silos_per_worker=1",
        "tracking.enabled=false",
        "train.local_epochs=1",
    )
    with pytest.raises(FederationError) as failed:
        Federation(cfg, callbacks=[lose]).run()
    reason = "no state to resume from"
    assert [s.round for s in lose.history] == [1, 2, 3]
    assert "could not rejoin" in lose.history[2].absent["va"]
    assert reason in lose.history[2].absent["va"]
    assert reason in str(failed.value)


class WakeAfter(Callback):
    """Sends SIGCONT to the process whose pid is in `marker` as round `round_` ends."""

    def __init__(self, marker: Path, round_: int) -> None:
        self.marker, self.round = marker, round_

    def on_round_end(self, summary) -> None:
        if summary.round == self.round:
            os.kill(int(self.marker.read_text()), signal.SIGCONT)


def test_a_silo_still_busy_with_an_older_round_is_sent_no_more_fits(job, ray_local, tmp_path):
    """va's process stops mid-fit in round 3 (SIGSTOP) until round 6 ends: its fit of round 4
    queues behind, but no later one does; rounds 5 and 6 say why va was left out, and still
    wait for it until the deadline. Once it answers, it takes part again."""
    marker = tmp_path / "stop_once.pid"
    cfg = job(
        "jobs/heart_disease.yaml",
        "plugins=[tests.fault_plugins]",
        "algorithm.name=stop_once",
        "algorithm.stop_once.silo=va",
        "algorithm.stop_once.round=3",
        f"algorithm.stop_once.marker={marker}",
        "rounds=8",
        "round.timeout_s=2",
        "round.min_silos=3",
        "ray.silos_per_worker=1",
        "tracking.enabled=false",
        "train.local_epochs=1",
    )
    try:
        result = Federation(cfg, callbacks=[WakeAfter(marker, 6)]).run()
    finally:
        if marker.exists():
            os.kill(int(marker.read_text()), signal.SIGCONT)
    absent = [s.absent.get("va") for s in result.history]
    late = "no answer within round.timeout_s=2 s"
    assert absent[2:4] == [late, late], absent
    assert absent[4:6] == ["still busy with its fit of round 3"] * 2, absent
    assert all(s.seconds >= 2 for s in result.history[4:6])
    assert "va" in result.history[7].participants


def test_packed_silos_each_get_round_timeout_s_as_silos_of_their_own_do(job, ray_local):
    """A worker runs its silos one after another and answers for them all at once: two silos
    of 1.2 s each in one worker answer after 2.4 s. Each silo is held to round.timeout_s=2, as in
    a process of its own: the worker gets 2 s for each of its silos, and every one is on time."""
    slow = (
        "plugins=[tests.fault_plugins]",
        "algorithm.name=slow_rounds",
        "algorithm.slow_rounds.seconds=1.2",
        "algorithm.slow_rounds.until=5",
    )
    cfg = job(
        "jobs/heart_disease.yaml",
        *slow,
        "rounds=2",
        "round.timeout_s=2",
        "round.retries=0",
        "ray.silos_per_worker=2",
        "tracking.enabled=false",
        "train.local_epochs=1",
    )
    result = Federation(cfg).run()
    everyone = ["cleveland", "hungarian", "switzerland", "va"]
    assert [s.participants for s in result.history] == [everyone, everyone]
    assert all(s.seconds >= 2.4 for s in result.history)  # each worker's two slow fits


def test_a_packed_silo_left_out_by_the_deadline_counts_as_late_in_the_live_metrics():
    """A packed worker's late reason carries its call's time; the metrics still say late."""
    from types import SimpleNamespace

    from silo_pfl.messages import RoundReport
    from silo_pfl.runtime.rounds import RoundRunner, late_reason

    recorded: dict[str, str] = {}
    runner = SimpleNamespace(
        timeout=2.0,
        parties={"a": SimpleNamespace(died=False), "b": SimpleNamespace(died=False)},
        metrics=SimpleNamespace(fits=lambda seconds: None, left_out=recorded.update),
    )
    absent = {
        "a": late_reason(2.0),
        "b": late_reason(2.0) + " (its worker's call for 2 silos: 4 s)",
    }
    report = RoundReport(1, (), {}, False, "")
    RoundRunner._record_fits(runner, {}, absent, set(), report)
    assert recorded == {"a": "late", "b": "late"}


def test_a_secure_runs_answered_fits_are_forgotten_round_by_round(job, ray_local, monkeypatch):
    """Under secure aggregation every fit is sent ahead; the driver still forgets those that
    answered, rather than keep a ref to each round's metrics of each silo for the whole run."""
    from silo_pfl.runtime.rounds import RoundRunner

    held: list[int] = []
    run = RoundRunner.run

    def counted(self, round_):
        summary = run(self, round_)
        held.append(max(len(fits) for fits in self.unanswered.values()))
        return summary

    monkeypatch.setattr(RoundRunner, "run", counted)
    cfg = job(
        "jobs/heart_disease.yaml",
        "aggregation.secure=true",
        "rounds=6",
        "tracking.enabled=false",
        "train.local_epochs=1",
    )
    Federation(cfg).run()
    assert len(held) == 6 and max(held) <= 2, held
