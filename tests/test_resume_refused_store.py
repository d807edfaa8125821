"""A silo's own store (silos.<name>.tracking_uri) that its node cannot use refuses a run before
the run or its MLflow runs change: a refused `--resume` leaves the finished run as it was (its
run.json, its result.json, its MLflow runs FINISHED), and a refused fresh run leaves neither a
directory nor an MLflow run in the central store."""

from __future__ import annotations

import json

from mlflow import MlflowClient

from silo_pfl.cli import main
from silo_pfl.run_dir import RESULT_FILE, RUN_FILE

JOB = "jobs/heart_disease.yaml"
FEDERATION = "heart_disease"


def test_a_resume_refused_by_a_silos_own_store_leaves_the_run_as_it_was(
    ray_local, tmp_path, capsys
):
    central = f"sqlite:///{tmp_path / 'central.db'}"
    own = tmp_path / "own"
    own.mkdir()
    args = [
        "run",
        JOB,
        "rounds=1",
        f"output_dir={tmp_path / 'runs'}",
        f"tracking.uri={central}",
        f"silos.va.tracking_uri=sqlite:///{own}/va.db",
        "--quiet",
    ]
    assert main(args) == 0
    (run,) = (tmp_path / "runs" / FEDERATION).iterdir()
    result, record = (run / RESULT_FILE).read_bytes(), (run / RUN_FILE).read_bytes()
    client = MlflowClient(central)
    parent = json.loads(result)["mlflow"]["run_id"]
    experiment = client.get_run(parent).info.experiment_id
    runs = client.search_runs([experiment])
    assert {r.info.status for r in runs} == {"FINISHED"} and len(runs) == 5

    own.rename(tmp_path / "moved")  # va's store is gone from its node
    capsys.readouterr()
    assert main([*args[:2], "rounds=2", *args[3:], "--resume"]) != 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "silos.va.tracking_uri" in err, err
    assert (run / RESULT_FILE).read_bytes() == result
    assert (run / RUN_FILE).read_bytes() == record
    assert client.get_run(parent).info.status == "FINISHED"
    after = {r.info.run_id: r for r in client.search_runs([experiment])}
    assert {r.info.status for r in after.values()} == {"FINISHED"} and len(after) == 5
    assert "resumes" not in after[parent].data.tags
    assert after[parent].data.tags["rounds"] == "1"


def test_a_fresh_run_refused_by_a_silos_own_store_leaves_no_mlflow_run(ray_local, tmp_path, capsys):
    central = f"sqlite:///{tmp_path / 'central.db'}"
    code = main(
        [
            "run",
            JOB,
            "rounds=1",
            f"output_dir={tmp_path / 'runs'}",
            f"tracking.uri={central}",
            f"silos.va.tracking_uri=sqlite:///{tmp_path}/nowhere/va.db",
            "--quiet",
        ]
    )
    err = capsys.readouterr().err
    assert code != 0 and err.count("\n") == 1 and "silos.va.tracking_uri" in err, err
    assert not (tmp_path / "runs" / FEDERATION).exists()
    client = MlflowClient(central)
    experiments = [e.experiment_id for e in client.search_experiments()]
    assert client.search_runs(experiments) == []
