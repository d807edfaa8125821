"""A tracking server's password never reaches a driver's output, nor a silo worker's: MLflow
prints a link to each run it ends in an HTTP store ("View run ... at: <store URI>"), which would
hold it. A real `mlflow server`, the CLI in a process of its own on the session's local Ray."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from drivers import joining_env, start_driver, until_round
from processes import mlflow_server as start_mlflow_server
from processes import stop_group
from serving import free_port

PASSWORD = "s3cretPW-in-the-uri"


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """A real `mlflow server` on a free port; its URI with a user and password, which MLflow
    sends and the server ignores. One for the module: its last test stops it."""
    port = free_port()
    with start_mlflow_server(tmp_path_factory.mktemp("mlflow_server"), port) as server:
        yield SimpleNamespace(uri=f"http://alice:{PASSWORD}@127.0.0.1:{port}", proc=server)


def test_a_store_password_is_printed_nowhere(ray_local, tmp_path, mlflow_server):
    mlflow_server = mlflow_server.uri
    args = ["run", "jobs/heart_disease.yaml", "rounds=1", f"output_dir={tmp_path / 'runs'}"]
    # va registers its model itself, from its silo's process, in a store given as its own.
    args += [f"tracking.uri={mlflow_server}", f"silos.va.tracking_uri={mlflow_server}"]
    results = tmp_path / "results.json"
    driver = start_driver([*args, "--quiet", "--results", str(results)], joining_env())
    try:
        out, err = driver.communicate(timeout=300)
    finally:
        stop_group(driver)
    assert driver.returncode == 0, err
    assert "mlflow: run " in out and "alice:***@" in out  # the run's own line, redacted
    assert json.loads(results.read_text())["mlflow"]["models"]["va"] == "models:/heart_disease-va/1"
    assert PASSWORD not in out + err
    # Nor in the silo workers' logs: va ended its run in its own store from its own process.
    logs = Path(ray_local._private.worker._global_node.get_logs_dir_path())
    leaked = [log.name for log in logs.glob("worker-*") if PASSWORD.encode() in log.read_bytes()]
    assert leaked == []


def test_a_store_that_goes_away_mid_run_stops_it_in_one_line(ray_local, tmp_path, mlflow_server):
    """The tracking server is stopped at round 3 of a run that logs to it. Before, MLflow's
    retries (about 4 minutes a call) froze the rounds silently for half an hour; now the run
    stops within seconds, naming the store, and leaves its runs to the resume."""
    slow = "algorithm.slow_rounds"
    args = ["run", "jobs/heart_disease.yaml", "rounds=40", f"output_dir={tmp_path / 'runs'}"]
    args += [f"tracking.uri={mlflow_server.uri}", "plugins=[tests.fault_plugins]"]
    args += ["algorithm.name=slow_rounds", f"{slow}.seconds=0.3", f"{slow}.until=40"]
    driver = start_driver(args, joining_env())
    try:
        until_round(driver, 3, 40)
        stop_group(mlflow_server.proc)
        out, err = driver.communicate(timeout=120)
    finally:
        stop_group(driver)
    assert driver.returncode == 1, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert (
        last.startswith("error: tracking.uri http://alice:***@127.0.0.1:")
        and "the store stopped answering as the run logged its figures (" in last
    ), last
    assert last.endswith("once it answers again, --resume goes on"), last
    assert "round 40/40" not in out and PASSWORD not in out + err
