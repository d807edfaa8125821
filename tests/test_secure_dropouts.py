"""Secure aggregation on a real local Ray with silos that die mid-protocol: after sending their
masked vectors, before, and too many. The survivors' exact sum is recovered and the run goes on;
below the threshold the round fails, naming why, and nothing is aggregated."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import numpy as np
import pytest

from silo_pfl import checkpoint
from silo_pfl.aggregation import weighted_mean
from silo_pfl.callbacks import Callback
from silo_pfl.errors import FederationError
from silo_pfl.federation import Federation
from silo_pfl.results import FederationResult

JOB = "jobs/digits_label_skew.yaml"
SIX = [f"silo_{i}" for i in range(6)]  # 6 silos: a secure round needs ceil(12/3) = 4

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_local")]


def _run(tmp_path: Path, *overrides: str) -> tuple[FederationResult, Path]:
    """Six silos, one per process, with FedPer that drops silos as `overrides` say and records
    every plain update; three secure rounds."""
    record = tmp_path / "updates"
    record.mkdir()
    options = [
        "data.num_silos=6",
        "rounds=3",
        "train.local_epochs=1",
        "aggregation.secure=true",
        "ray.silos_per_worker=1",
        "plugins=[tests.secure_plugins]",
        "algorithm.name=drop_at",
        f"algorithm.drop_at.record={record}",
        "tracking.enabled=false",
        f"output_dir={tmp_path / 'runs'}",
    ]
    return Federation(JOB, [*options, *overrides]).run(), record


def _global(run_dir: Path, round_: int) -> dict[str, np.ndarray]:
    saved = checkpoint.load(run_dir / "server", round_)["global"]
    return {k: v.astype(np.float64) for k, v in saved.items()}


def _assert_exact_sum(result: FederationResult, record: Path, round_: int, included) -> None:
    """The round's new global keys are the old plus the weighted mean of exactly the included
    silos' plain updates (FedPer's server step is the mean): the survivors' sum, unmasked."""
    before, after = (_global(Path(result.run_dir), r) for r in (round_ - 1, round_))
    deltas, weights = [], []
    for silo in included:
        saved = dict(np.load(record / f"{round_}-{silo}.npz"))
        weights.append(int(saved.pop("weight")))
        deltas.append(saved)
    expected = weighted_mean(deltas, weights)
    assert set(expected) == set(after)
    for key, value in after.items():
        np.testing.assert_allclose(value - before[key], expected[key], rtol=0, atol=2e-6)


@pytest.mark.parametrize(
    ("dropped", "step"),
    [
        (["silo_2"], "after_masking"),
        (["silo_1", "silo_4"], "after_masking"),
        (["silo_3"], "before_masking"),
    ],
    ids=["1-after-masking", "2-after-masking", "1-before-masking"],
)
def test_silos_killed_mid_protocol_leave_the_survivors_exact_sum(tmp_path, dropped, step):
    result, record = _run(
        tmp_path,
        f"algorithm.drop_at.silos=[{','.join(dropped)}]",
        f"algorithm.drop_at.step={step}",
    )
    assert [s.round for s in result.history] == [1, 2, 3]
    second = result.history[1]
    # Killed after masking, a silo's vector is in the sum; killed before, it is not.
    included = SIX if step == "after_masking" else sorted(set(SIX) - set(dropped))
    assert second.participants == included and second.attempts == 1
    assert set(dropped) <= set(second.absent)  # it evaluated nothing that round
    _assert_exact_sum(result, record, 2, included)
    _assert_exact_sum(result, record, 3, SIX)  # they restarted and rejoined
    assert {s: result.silos[s].restarts for s in dropped} == dict.fromkeys(dropped, 1)


def test_below_the_threshold_the_round_fails_and_nothing_is_aggregated(tmp_path):
    """Three of six die before revealing: 3 shares of each seed, 4 needed."""
    with pytest.raises(FederationError) as failed:
        _run(
            tmp_path,
            "algorithm.drop_at.silos=[silo_0,silo_1,silo_2]",
            "round.retries=0",
        )
    message = str(failed.value)
    assert message.startswith("round 2: no quorum after 1 attempts (round.retries=0); last: ")
    assert (
        "shares of silo silo_" in message and "arrived, 4 needed; nothing is aggregated" in message
    )
    (run_dir,) = (tmp_path / "runs" / "digits_label_skew").iterdir()
    assert checkpoint.rounds(run_dir / "server") == [0, 1]


class KillAt(Callback):
    """SIGKILLs the process of `silo` (and of the silos packed with it) during round `round_`."""

    def __init__(self, silo: str, round_: int, delay: float) -> None:
        self.silo, self.round, self.delay = silo, round_, delay

    def on_start(self, config, silos, split) -> None:
        self.pid = next(info.pid for info in silos if info.silo == self.silo)
        self.victims = sorted(info.silo for info in silos if info.pid == self.pid)

    def on_round_start(self, round_: int) -> None:
        if round_ == self.round:
            threading.Timer(self.delay, os.kill, args=(self.pid, signal.SIGKILL)).start()


def test_the_label_skew_job_with_masking_survives_two_silos_killed_mid_run(tmp_path):
    """jobs/digits_label_skew.yaml under secure aggregation, two silos per process; one process
    is killed in round 15. Ray restarts it, both silos restore their last commit, and the run's
    mean accuracy stays within 0.01 of the run without faults."""
    options = ["aggregation.secure=true", "ray.silos_per_worker=2", "tracking.enabled=false"]
    clean = Federation(JOB, [*options, f"output_dir={tmp_path / 'clean'}"]).run()
    killer = KillAt("silo_3", 15, 0.05)
    faulty = Federation(JOB, [*options, f"output_dir={tmp_path / 'faulty'}"], [killer]).run()
    assert len(killer.victims) == 2
    assert len(faulty.history) == 30
    assert {s: faulty.silos[s].restarts for s in killer.victims} == dict.fromkeys(killer.victims, 1)
    hit = faulty.history[14]
    print(
        f"round 15: attempts {hit.attempts}, participants {len(hit.participants)}, restarted "
        f"{sorted(hit.restarted)}; mean test accuracy {faulty.mean_test_accuracy:.4f} with "
        f"the kill, {clean.mean_test_accuracy:.4f} without"
    )
    assert abs(faulty.mean_test_accuracy - clean.mean_test_accuracy) <= 0.01
