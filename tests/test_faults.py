"""Faults on a real local Ray: a silo killed mid-round, a hung silo, a silo whose training turns
to NaN, and the driver killed and resumed. The run goes on, and resumes bit for bit."""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import numpy as np
import pytest
from drivers import StopAfter, joining_env, run_driver, start_driver

from silo_pfl import checkpoint
from silo_pfl.callbacks import Callback
from silo_pfl.errors import FederationError
from silo_pfl.federation import Federation
from silo_pfl.progress import ProgressPrinter
from silo_pfl.results import FederationResult
from silo_pfl.silo_store import CHECKPOINTS, SELECTED
from silo_pfl.tensor_state import as_tensors, local_digest

JOB = "jobs/heart_disease.yaml"
T = TypeVar("T")
ROUNDS = 6
LOCAL_EPOCHS = 20

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_local")]


class Watch(Callback):
    """Finds one silo's process at the start, and records the digest of the local keys each
    silo checkpointed, round by round, from its files."""

    def __init__(self, silo: str) -> None:
        self.silo = silo
        self.digests: dict[str, dict[int, str]] = {}  # silo -> round -> its local keys' digest

    def on_start(self, config, silos, split) -> None:
        self.pid = next(info.pid for info in silos if info.silo == self.silo)
        # The silos in the same process as `silo` (packed with it), itself included.
        self.housemates = sorted(info.silo for info in silos if info.pid == self.pid)
        self.dir = Path(config.output_dir) / config.name

    def on_round_end(self, summary) -> None:
        for folder in self.dir.glob(f"*/silos/*/{CHECKPOINTS}"):
            if summary.round in checkpoint.rounds(folder):
                state = checkpoint.load(folder, summary.round)["local"]
                digests = self.digests.setdefault(folder.parent.name, {})
                digests[summary.round] = local_digest(as_tensors(state), list(state))


class AtRound(Watch):
    """Does `act(pid)` to one silo's process, `delay` s after round `round_` starts."""

    def __init__(self, silo: str, round_: int, delay: float, act) -> None:
        super().__init__(silo)
        self.round, self.delay, self.act = round_, delay, act

    def on_round_start(self, round_: int) -> None:
        if round_ == self.round:
            threading.Timer(self.delay, self.act, args=(self.pid,)).start()


def _once(tmp_path: Path, fault: str, silo: str, round_: int) -> list[str]:
    """The overrides of a fault of tests/fault_plugins.py that strikes `silo` mid-fit in
    `round_`, once."""
    return [
        "plugins=[tests.fault_plugins]",
        f"algorithm.name={fault}",
        f"algorithm.{fault}.silo={silo}",
        f"algorithm.{fault}.round={round_}",
        f"algorithm.{fault}.marker={tmp_path / (fault + '.pid')}",
    ]


def _run(tmp_path: Path, name: str, *overrides: str, callbacks=()) -> FederationResult:
    options = [
        f"rounds={ROUNDS}",
        f"train.local_epochs={LOCAL_EPOCHS}",
        f"output_dir={tmp_path / name}",
    ]
    return Federation(JOB, [*options, *overrides], callbacks).run()


def _final_states(result: FederationResult | dict) -> dict[str, np.ndarray]:
    """The global keys and every silo's committed local and personal state, as arrays."""
    summary = result if isinstance(result, dict) else result.to_dict()
    arrays = dict(np.load(summary["global_state_path"]))
    for silo in summary["silos"]:
        folder = Path(summary["run_dir"]) / "silos" / silo / CHECKPOINTS
        saved = checkpoint.load(folder, checkpoint.rounds(folder)[-1])
        saved["selected_state"] = checkpoint.load(
            folder.parent / SELECTED, json.loads(saved["figures"])["selected"]["round"]
        )
        for part in ("local", "algorithm", "selected_state"):
            for key, value in (saved[part] or {}).items():
                arrays[f"{silo}/{part}/{key}"] = np.asarray(value)
    return arrays


def _assert_bit_equal(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert set(a) == set(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and np.array_equal(a[key], b[key]), key


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory) -> FederationResult:
    """The fault-free run the faulty ones are compared with."""
    return _run(tmp_path_factory.mktemp("undisturbed"), "runs", "tracking.enabled=false")


@pytest.mark.parametrize("per_worker", ["1", "2"])
def test_a_silo_killed_mid_round_restarts_from_its_checkpoint(
    tmp_path, mlflow_store, undisturbed, per_worker
):
    """va's process is killed in the middle of its fit: alone in it, va restarts; packed with
    another silo, both do. Each restores its own commit, and the run equals the undisturbed
    (packed) one bit for bit."""
    killer = Watch("va")
    die = _once(tmp_path, "die_once", "va", 3)
    result = _run(tmp_path, "runs", *die, f"ray.silos_per_worker={per_worker}", callbacks=[killer])
    assert (tmp_path / "die_once.pid").read_text() == str(killer.pid), "va killed itself once"
    assert len(killer.housemates) == int(per_worker) and "va" in killer.housemates
    third = result.history[2]
    assert third.attempts == 2, "the round without va had no quorum and was tried again"
    # Each silo of the killed process restored, bit for bit, the local keys it had checkpointed
    # in round 2, before the crash; the others did not restart.
    assert sorted(third.restarted) == killer.housemates
    for silo in killer.housemates:
        assert third.restarted[silo]["round"] == 2
        assert third.restarted[silo]["local_digest"] == killer.digests[silo][2]
        assert third.restarted[silo]["pid"] != killer.pid
        assert result.silos[silo].restarts == 1
    assert sum(s.restarts for s in result.silos.values()) == int(per_worker)
    assert all(
        s.participants == ["cleveland", "hungarian", "switzerland", "va"] for s in result.history
    )
    assert abs(result.mean_test_accuracy - undisturbed.mean_test_accuracy) <= 0.02
    # Stronger: every silo retried from its round-2 commit, so the run equals the undisturbed one.
    _assert_bit_equal(_final_states(result), _final_states(undisturbed))
    from mlflow import MlflowClient

    client = MlflowClient(mlflow_store)
    child = client.get_run(result.extras["mlflow"]["run_id"])
    runs = client.search_runs(
        [child.info.experiment_id], f"tags.mlflow.parentRunId = '{child.info.run_id}'"
    )
    va = next(r for r in runs if r.data.tags["silo"] == "va")
    assert va.data.tags["restarts"] == "1"
    assert va.data.tags["round_3_restored"] == killer.digests["va"][2]


def _silo_workers() -> set[int]:
    """The pids of this machine's silo worker processes (Ray titles them ray::SiloHost)."""
    pids = set()
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if entry.name.isdigit() and (entry / "cmdline").read_bytes().startswith(
                b"ray::SiloHost"
            ):
                pids.add(int(entry.name))
    return pids


class KillWhenIdle(Watch):
    """Kills one silo's worker once every silo is set up and built, while it runs no call, and
    waits until Ray has started its replacement: the next call reaches a worker that is empty."""

    def on_start(self, config, silos, split) -> None:
        super().on_start(config, silos, split)
        before = _silo_workers()
        os.kill(self.pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while not (_silo_workers() - before) and time.monotonic() < deadline:
            time.sleep(0.1)
        self.replaced = bool(_silo_workers() - before) and self.pid not in _silo_workers()


def test_a_worker_killed_while_idle_is_rejoined_at_its_next_call(tmp_path, undisturbed):
    """va's worker, packed with another silo, dies between calls. Ray starts it again, empty;
    the first round's fits find neither silo there. Both count as died and rejoin from their
    round-0 commit, and the run equals the undisturbed one bit for bit. Before, the empty worker
    answered "holds no silos" as a failure, no silo rejoined, and the run ended without quorum."""
    killer = KillWhenIdle("va")
    result = _run(
        tmp_path, "runs", "ray.silos_per_worker=2", "tracking.enabled=false", callbacks=[killer]
    )
    assert killer.replaced and len(killer.housemates) == 2
    first = result.history[0]
    assert sorted(first.restarted) == killer.housemates
    assert all(first.restarted[s]["round"] == 0 for s in killer.housemates)
    assert {s: r.restarts for s, r in result.silos.items()} == {
        s: int(s in killer.housemates) for s in result.silos
    }
    _assert_bit_equal(_final_states(result), _final_states(undisturbed))


@pytest.mark.parametrize("driver", ["goes_on", "resumed"])
def test_scaffolds_silo_killed_after_its_update_was_aggregated_keeps_c_the_mean(tmp_path, driver):
    """va's process is killed as it evaluates round 3, after the server added its Delta c_i. It
    rejoins with the c_i that update carried, committed as round 3, so at the end the server's
    c is still the mean of the four silos' c_i (weighted by their rows). Before, va went back to
    round 2's c_i. The same holds where the driver stops once round 3 is checkpointed, before va
    rejoins, and the run is resumed: the driver's bookkeeping keeps which update of va's was
    aggregated uncommitted."""
    fault = "scaffold_dies_in_evaluation"
    options = [f"algorithm.{fault}.{k}={v}" for k, v in (("silo", "va"), ("round", 3))]
    marker = tmp_path / "died.pid"
    overrides = [
        "plugins=[tests.fault_plugins]",
        f"algorithm.name={fault}",
        *options,
        f"algorithm.{fault}.marker={marker}",
        "train.optimizer=sgd",
        "tracking.enabled=false",
        "rounds=4",
        "train.local_epochs=5",
    ]
    if driver == "resumed":
        with pytest.raises(KeyboardInterrupt):
            _run(tmp_path, "runs", *overrides, callbacks=[StopAfter(3)])
        options = [f"rounds={ROUNDS}", f"train.local_epochs={LOCAL_EPOCHS}"]
        config = [*options, f"output_dir={tmp_path / 'runs'}", *overrides]
        result = Federation(JOB, config).run(resume=True)
        assert marker.exists() and result.silos["va"].restarts == 0
        assert "va" in result.history[3].participants
    else:
        result = _run(tmp_path, "runs", *overrides)
        assert marker.exists() and result.silos["va"].restarts == 1
        assert result.history[3].restarted["va"]["round"] == 3
    run_dir = Path(result.to_dict()["run_dir"])
    server = checkpoint.load(run_dir / "server", 4)["strategy"]["c"]
    silos = []
    for silo in result.silos:
        folder = run_dir / "silos" / silo / CHECKPOINTS
        saved = checkpoint.load(folder, checkpoint.rounds(folder)[-1])["algorithm"]
        silos.append({k.removeprefix("scaffold.c."): v for k, v in saved.items()})
    rows = np.array([result.silos[silo].num_train for silo in result.silos], np.float64)
    for key, value in server.items():
        c_i = np.stack([np.asarray(s[key], np.float64) for s in silos])
        mean = np.tensordot(rows / rows.sum(), c_i, axes=1)  # weighted as the model's step
        np.testing.assert_allclose(value, mean, rtol=0, atol=1e-6)


def test_a_silo_whose_commits_answer_late_is_resumed_from_its_own_last_commit(tmp_path):
    """va's evaluations of rounds 2 to 6 answer after the deadline, so the driver never hears
    its commits; va commits them on its disk all the same, and keeps only its newest 3. Each
    next fit says what va had committed, so the driver's record, which a resume restores, is a
    round va still holds. Before, it stayed at round 1, pruned since: no round was held intact
    by every silo, and the run could not be resumed."""
    slow = "algorithm.slow_evaluation"
    overrides = [
        "plugins=[tests.fault_plugins]",
        "algorithm.name=slow_evaluation",
        f"{slow}.silo=va",
        f"{slow}.first=2",
        f"{slow}.last=6",
        f"{slow}.seconds=3.5",  # past the deadline, and its next fit well before the next
        "round.timeout_s=3",
        "round.min_silos=3",
        "ray.silos_per_worker=1",
        "tracking.enabled=false",
        "train.local_epochs=2",
    ]
    result = _run(tmp_path, "runs", *overrides)
    late = "its update was aggregated, but its evaluation and commit: no answer within"
    assert all(s.absent.get("va", "").startswith(late) for s in result.history[1:])
    run_dir = Path(result.to_dict()["run_dir"])
    committed = checkpoint.load(run_dir / "server", ROUNDS)["driver"]["committed"]
    assert committed["va"] == ROUNDS - 1  # round 6's commit answered late too
    again = Federation(JOB, [f"output_dir={tmp_path / 'runs'}", *overrides, "rounds=7"])
    resumed = again.run(resume=True)
    assert len(resumed.history) == 7 and "va" in resumed.history[-1].participants


def test_a_hung_silo_is_left_out_by_the_deadline_and_rejoins(tmp_path, mlflow_store, caplog):
    timeout = 3.0

    """va's process stops in the middle of its fit in round 3, and goes on 2 s after the
    deadline (SIGSTOP, then SIGCONT)."""
    waker = AtRound("va", 3, timeout + 2, lambda pid: os.kill(pid, signal.SIGCONT))
    # va alone in its process, as on a node of its own: stopping it stops no other silo.
    quorum = ("round.min_silos=3", f"round.timeout_s={timeout}", "ray.silos_per_worker=1")
    stop = _once(tmp_path, "stop_once", "va", 3)
    printed = io.StringIO()
    result = _run(tmp_path, "runs", *stop, *quorum, callbacks=[waker, ProgressPrinter(printed)])
    assert (tmp_path / "stop_once.pid").read_text() == str(waker.pid), "va stopped itself"
    reason = f"no answer within round.timeout_s={timeout:g} s"
    said = [r.getMessage() for r in caplog.records if reason in r.getMessage()]
    assert said == [f"round 3: silo va left out: {reason}"], "the reason is said once"
    assert reason not in printed.getvalue()
    third_line = next(s for s in printed.getvalue().splitlines() if s.startswith("round 3/"))
    assert third_line.endswith("  left out: va"), third_line
    third = result.history[2]
    assert third.participants == ["cleveland", "hungarian", "switzerland"]
    assert third.absent == {"va": f"no answer within round.timeout_s={timeout:g} s"}
    assert third.seconds <= timeout + 2
    assert "va" in result.history[-1].participants, "va rejoined once it answered again"
    assert result.silos["va"].restarts == 0
    assert result.silos["va"].rounds_taken_part < ROUNDS
    from mlflow import MlflowClient

    client = MlflowClient(mlflow_store)
    parent = client.get_run(result.extras["mlflow"]["run_id"])
    runs = client.search_runs(
        [parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'"
    )
    va = next(r for r in runs if r.data.tags["silo"] == "va")
    took_part = {m.step: m.value for m in client.get_metric_history(va.info.run_id, "took_part")}
    assert took_part[3] == 0.0 and took_part[ROUNDS] == 1.0
    assert va.data.tags["round_3_left_out"] == third.absent["va"]


def test_a_silo_whose_training_turns_to_nan_sends_nothing_that_round(tmp_path, undisturbed):
    nan = (
        "plugins=[tests.fault_plugins]",
        "algorithm.name=nan_once",
        "algorithm.nan_once.silo=va",
        "algorithm.nan_once.round=3",
        "round.min_silos=3",
        "tracking.enabled=false",
    )
    result = _run(tmp_path, "runs", *nan)
    third = result.history[2]
    assert third.participants == ["cleveland", "hungarian", "switzerland"]
    assert third.absent["va"].startswith("training diverged (")
    assert "is not finite); it sends no update this round" in third.absent["va"]
    assert all(np.isfinite(v) for s in result.history for v in s.silos.get("va", {}).values())
    assert "va" in result.history[3].participants

    # The other silos are unaffected until round 3 aggregates without va.
    def scores(summary, silo: str) -> list[float]:
        values = summary.silos[silo]
        return [values[k] for k in ("train_loss", "val_accuracy", "test_accuracy")]

    for before, after in zip(undisturbed.history[:2], result.history[:2], strict=True):
        for silo in before.silos:
            assert scores(before, silo) == scores(after, silo)
    third_before = undisturbed.history[2]
    assert scores(third, "cleveland")[:1] == scores(third_before, "cleveland")[:1]
    assert result.history[3].silos["cleveland"] != undisturbed.history[3].silos["cleveland"]


def test_a_silo_left_out_of_every_evaluated_round_is_named_and_resume_selects_it(tmp_path):
    """va's fit fails in round 1, the only round: it has no model to select. The run says so in
    one line, not at its last step with a RuntimeError, and a resume with one more round gives va
    its first evaluated model, whether or not that round wins for the others."""
    overrides = [
        "plugins=[tests.fault_plugins]",
        "algorithm.name=raise_once",
        "algorithm.raise_once.silo=va",
        "algorithm.raise_once.round=1",
        f"algorithm.raise_once.marker={tmp_path / 'raised'}",
        "round.min_silos=3",
        "tracking.enabled=false",
        f"output_dir={tmp_path / 'runs'}",
    ]
    with pytest.raises(FederationError) as caught:
        Federation(JOB, [*overrides, "rounds=1"]).run()
    assert str(caught.value) == (
        "silo va: left out of every evaluated round, it has no model to select; resume with "
        "more rounds (--resume rounds=2 or more)"
    )
    result = Federation(JOB, [*overrides, "rounds=2"]).run(resume=True)
    assert result.silos["va"].selected_round == 2
    assert "va" not in result.history[0].participants and "va" in result.history[1].participants
    assert {s.selected_round for n, s in result.silos.items() if n != "va"} <= {1, 2}


def _kill_after_round(proc: subprocess.Popen, kill_after: int) -> None:
    """SIGKILL the driver `proc` once its progress says round `kill_after` is done."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(f"round {kill_after}/"):
            os.kill(proc.pid, signal.SIGKILL)
            return


def _sigkilled_then_resumed(
    tmp_path: Path, overrides: list[str], kill_after: int, meanwhile: Callable[[], T]
) -> tuple[Path, T]:
    """`silo-pfl run` killed with SIGKILL once round `kill_after` is done, then `--resume`;
    `meanwhile()` runs in this process while the run to be killed goes on. The resumed run's
    results file, and what `meanwhile` returned."""
    command = ["run", JOB, *overrides]
    env = joining_env()
    proc = start_driver(command, env, stderr=subprocess.DEVNULL)
    watcher = threading.Thread(target=_kill_after_round, args=(proc, kill_after), daemon=True)
    watcher.start()
    try:
        beside = meanwhile()
        watcher.join(timeout=300)
        proc.wait(timeout=30)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # anything the driver started
    assert proc.returncode == -signal.SIGKILL
    code, err = run_driver([*command, "--resume", "--results", str(tmp_path / "resumed.json")], env)
    assert code == 0, err[-2000:]
    return tmp_path / "resumed.json", beside


@pytest.mark.parametrize(
    "variant",
    [
        ["algorithm.name=fedper"],
        ["algorithm.name=ditto", "eval.every=2"],  # killed after round 3, which is not evaluated
        ["aggregation.secure=true"],
    ],
    ids=["fedper", "ditto-eval-every-2", "fedper-secure"],
)
def test_the_driver_killed_at_a_random_round_then_resumed_is_bit_exact(
    tmp_path, variant, undisturbed, mlflow_store
):
    kill_after = random.Random(" ".join(variant)).randint(1, ROUNDS - 2)
    fedper = variant == ["algorithm.name=fedper"]
    overrides = [*variant, f"rounds={ROUNDS}", f"train.local_epochs={LOCAL_EPOCHS}"]

    def straight_run() -> FederationResult:
        if fedper:
            return undisturbed  # the same run: fedper is the job's algorithm
        options = [*overrides, "tracking.enabled=false", f"output_dir={tmp_path / 'straight'}"]
        return Federation(JOB, options).run()

    # fedper's killed run is tracked: its last rounds' metrics die unsent with the driver.
    tracked = [f"tracking.enabled={fedper}"]
    path, straight = _sigkilled_then_resumed(
        tmp_path,
        [*overrides, *tracked, f"output_dir={tmp_path / 'killed'}"],
        kill_after,
        straight_run,
    )
    resumed = json.loads(path.read_text())
    assert [h["round"] for h in resumed["history"]] == list(range(1, ROUNDS + 1))
    assert [h["evaluated"] for h in resumed["history"]] == [s.evaluated for s in straight.history]
    assert resumed["mean_test_accuracy"] == straight.mean_test_accuracy
    _assert_bit_equal(_final_states(resumed), _final_states(straight))
    if fedper:
        from mlflow import MlflowClient

        parent = resumed["mlflow"]["run_id"]
        steps = [
            m.step for m in MlflowClient(mlflow_store).get_metric_history(parent, "round_seconds")
        ]
        assert sorted(steps) == list(range(1, ROUNDS + 1)), "one run, every round logged once"


def test_two_runs_of_one_federation_run_side_by_side(tmp_path):
    """Two drivers of the same federation at once, one output_dir: two run directories."""
    command = [
        *("run", JOB, "rounds=3", "tracking.enabled=false"),
        *(f"output_dir={tmp_path / 'runs'}", "--quiet", "--results"),
    ]
    env = joining_env()
    procs = [
        start_driver([*command, str(tmp_path / f"{i}.json")], env, stdout=subprocess.DEVNULL)
        for i in range(2)
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
    first, second = (json.loads((tmp_path / f"{i}.json").read_text()) for i in range(2))
    assert first["run_id"] != second["run_id"]
    assert Path(first["run_dir"]).parent == Path(second["run_dir"]).parent
    for key in ("mean_test_accuracy", "worst_test_accuracy"):
        assert first[key] == second[key], "the same seed gives the same numbers, side by side"
    runs = sorted(p.name for p in (tmp_path / "runs" / "heart_disease").iterdir())
    assert runs == sorted([first["run_id"], second["run_id"]])
    starts, ends = [], []
    for summary in (first, second):
        run_dir = Path(summary["run_dir"])
        starts.append(json.loads((run_dir / "run.json").read_text())["started_ns"])
        ends.append((run_dir / "result.json").stat().st_mtime_ns)
    assert max(starts) < min(ends), "the two runs overlapped in time"
