"""SIGTERM (what `ray job stop` sends) stops a run cleanly: MLflow says KILLED, nothing is left,
the last line names the run and round to resume, and `--resume` then completes the run in the
same MLflow run, its wall time counting both parts."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
from drivers import joining_env, run_driver, start_driver, until_round

from silo_pfl import checkpoint

pytestmark = pytest.mark.slow


def _in_session(sid: int) -> list[int]:
    """Live processes of session `sid` (the run and everything it started: Ray, its workers)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != "Z":
                found.append(int(entry.name))
    return found


def test_sigterm_during_round_5_ends_the_run_as_killed_then_resume_completes_it(
    ray_local, tmp_path, mlflow_store
):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    slow = "algorithm.slow_rounds"  # rounds 1-7 take seconds: the first part's wall time is known
    command = [
        *("run", "jobs/heart_disease.yaml", "rounds=12", "train.local_epochs=10"),
        *("ray.num_cpus=2", f"output_dir={tmp_path / 'runs'}", "plugins=[tests.fault_plugins]"),
        *("algorithm.name=slow_rounds", f"{slow}.seconds=0.5", f"{slow}.until=7"),
    ]
    proc = start_driver(command, env)
    try:
        until_round(proc, 5, 12)
        began = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        elapsed = time.monotonic() - began
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert elapsed < 10, elapsed
    assert proc.returncode == 143  # 128 + SIGTERM, as a process the signal ended
    last = err.strip().splitlines()[-1]
    said = re.fullmatch(
        r"error: stopped by SIGTERM; run (\S+) resumes from its round (\d+) with --resume \1", last
    )
    assert said, last
    run_id, round_ = said[1], int(said[2])
    assert 5 <= round_ < 12
    saved = checkpoint.load_latest(tmp_path / "runs" / "heart_disease" / run_id / "server")
    assert saved is not None and saved[0] == round_
    earlier_seconds = saved[1]["driver"]["elapsed_s"]
    deadline = time.monotonic() + 15  # Ray's own processes may take a moment to go
    while _in_session(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _in_session(proc.pid) == []
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_store)
    runs = client.search_runs([client.get_experiment_by_name("heart_disease").experiment_id])
    assert len(runs) == 5  # the federation's run and one per hospital
    assert {run.info.status for run in runs} == {"KILLED"}

    results = tmp_path / "resumed.json"
    # The resume joins the session's Ray: the first part tested a local Ray's stop.
    resume = [*command, "--resume", run_id, "--results", str(results)]
    code, err = run_driver([x for x in resume if x != "ray.num_cpus=2"], joining_env())
    assert code == 0, err[-2000:]
    summary = json.loads(results.read_text())
    assert [h["round"] for h in summary["history"]] == list(range(1, 13))
    resumed_rounds = sum(h["seconds"] for h in summary["history"][round_:])
    assert summary["wall_seconds"] > earlier_seconds + resumed_rounds
    again = client.search_runs([client.get_experiment_by_name("heart_disease").experiment_id])
    assert {run.info.run_id for run in again} == {run.info.run_id for run in runs}
    assert {run.info.status for run in again} == {"FINISHED"}
    parent = next(r for r in again if "mlflow.parentRunId" not in r.data.tags)
    assert parent.info.run_id == summary["mlflow"]["run_id"]
    assert parent.data.tags["resumes"] == "1"
    steps = [m.step for m in client.get_metric_history(parent.info.run_id, "round_seconds")]
    assert sorted(steps) == list(range(1, 13)), "every round logged once: no gap, no repeat"


def _named(pids: list[int], name: str) -> bool:
    """Whether one of `pids` is a process whose command line starts with `name`."""
    for pid in pids:
        try:
            if (Path("/proc") / str(pid) / "cmdline").read_bytes().startswith(name.encode()):
                return True
        except OSError:
            continue
    return False


def test_ctrl_c_while_ray_starts_leaves_no_ray_process(tmp_path):
    """SIGINT as soon as the local Ray's agents are up, while `ray.init` still waits for its
    node: before, the GCS and the agents outlived the command by a minute or more, as that
    interrupted `ray.init` left them where no shutdown could find them."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    command = ["run", "jobs/heart_disease.yaml", "rounds=50", "tracking.enabled=false"]
    proc = start_driver(
        [*command, f"output_dir={tmp_path / 'runs'}"],
        env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as a terminal's
    )
    try:
        deadline = time.monotonic() + 60
        while not _named(_in_session(proc.pid), "ray::DashboardAgent"):
            assert proc.poll() is None and time.monotonic() < deadline, "no agent started"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
        deadline = time.monotonic() + 20
        while _in_session(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _in_session(proc.pid) == []
    finally:
        if _in_session(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130


def test_ctrl_c_pressed_again_during_the_clean_up_keeps_the_resume_line(tmp_path):
    """Ctrl-C three times, 0.3 s apart, to the whole process group, as an impatient user does:
    the later ones come while the run cleans up. The last line still names the run and round
    to resume, and the exit is 130; before, the second replaced the first and the line said
    only 'interrupted', exit 1."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    command = [
        *("run", "jobs/heart_disease.yaml", "rounds=60", "tracking.enabled=false"),
        *("ray.num_cpus=2", f"output_dir={tmp_path / 'runs'}"),
    ]
    as_a_terminal = {"preexec_fn": lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)}
    proc = start_driver(command, env, **as_a_terminal)
    try:
        until_round(proc, 10, 60)
        for _ in range(3):
            os.killpg(proc.pid, signal.SIGINT)
            time.sleep(0.3)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    last = err.strip().splitlines()[-1]
    said = re.fullmatch(
        r"error: interrupted; run (\S+) resumes from its round (\d+) with --resume \1", last
    )
    assert said and proc.returncode == 130, (proc.returncode, err[-2000:])
