"""SIGTERM (what `ray job stop` sends) stops a run cleanly: MLflow says KILLED, nothing is left,
and `--resume` then completes the run in the same MLflow run."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from drivers import run_driver, start_driver

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
    tmp_path, mlflow_store
):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    command = [
        *("run", "jobs/heart_disease.yaml", "rounds=12", "train.local_epochs=10"),
        *("ray.num_cpus=2", f"output_dir={tmp_path / 'runs'}"),
    ]
    proc = start_driver(command, env)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("round  5/12"):
                break
        else:
            pytest.fail(f"the run ended before round 5: {proc.communicate()[1]}")
        began = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        elapsed = time.monotonic() - began
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert elapsed < 10, elapsed
    assert proc.returncode == 130
    assert err.strip().splitlines()[-1] == "error: interrupted"
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
    code, err = run_driver([*command, "--resume", "--results", str(results)], env)
    assert code == 0, err[-2000:]
    summary = json.loads(results.read_text())
    assert [h["round"] for h in summary["history"]] == list(range(1, 13))
    again = client.search_runs([client.get_experiment_by_name("heart_disease").experiment_id])
    assert {run.info.run_id for run in again} == {run.info.run_id for run in runs}
    assert {run.info.status for run in again} == {"FINISHED"}
    parent = next(r for r in again if "mlflow.parentRunId" not in r.data.tags)
    assert parent.info.run_id == summary["mlflow"]["run_id"]
    assert parent.data.tags["resumes"] == "1"
    steps = [m.step for m in client.get_metric_history(parent.info.run_id, "round_seconds")]
    assert sorted(steps) == list(range(1, 13)), "every round logged once: no gap, no repeat"
