"""A `--resume` that fails leaves the run as it was (its record, its result, its MLflow runs); a
partial newest checkpoint is named on stderr and the round before it resumed; a run.json that is
not a run's record is named in one line."""

from __future__ import annotations

import json

import pytest
from mlflow import MlflowClient

from silo_pfl.cli import main
from silo_pfl.run_dir import RESULT_FILE, RUN_FILE

JOB = "jobs/heart_disease.yaml"
FEDERATION = "heart_disease"


def test_a_run_json_that_is_not_a_record_is_named(tmp_path, capsys):
    run = tmp_path / FEDERATION / "20261206-000000-bad003"
    run.mkdir(parents=True)
    (run / RUN_FILE).write_text("[1, 2]")
    code = main(["run", JOB, f"output_dir={tmp_path}", "--resume", run.name])
    assert code == 2
    assert capsys.readouterr().err == (
        f"error: --resume: {run / RUN_FILE} is not a run's record (a JSON object with its config)\n"
    )


@pytest.mark.slow
def test_a_failed_resume_changes_nothing_and_a_partial_checkpoint_is_named(
    ray_local, tmp_path, capsys, mlflow_store
):
    out = f"output_dir={tmp_path}"
    assert main(["run", JOB, "rounds=2", out, "--quiet"]) == 0
    capsys.readouterr()
    (finished,) = (tmp_path / FEDERATION).iterdir()
    client = MlflowClient(mlflow_store)
    parent = json.loads((finished / RESULT_FILE).read_text())["mlflow"]["run_id"]
    assert client.get_run(parent).info.status == "FINISHED"

    # Every checkpoint of silo va (rounds 0 to 2) is damaged: no round can be resumed.
    checkpoints = finished / "silos" / "va" / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("*.ckpt"))[0] == "round-000000.ckpt"
    for path in checkpoints.glob("*.ckpt"):
        path.write_bytes(b"garbage")
    record = (finished / RUN_FILE).read_bytes()
    code = main(["run", JOB, "rounds=3", out, "--quiet", "--resume", finished.name])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1, err
    assert err.startswith(f"error: checkpoint {checkpoints / 'round-000000.ckpt'}: "), err
    assert err.endswith("; no earlier round is held intact by the server and every silo\n"), err
    assert (finished / RESULT_FILE).is_file() and (finished / RUN_FILE).read_bytes() == record
    assert client.get_run(parent).info.status == "FINISHED"

    # Silo va's newest checkpoint alone is damaged: the run resumes from the round before it,
    # which every party holds, and ends as a run made at once.
    out = f"output_dir={tmp_path / 'silo'}"
    off = "tracking.enabled=false"
    assert main(["run", JOB, "rounds=2", out, "--quiet", off]) == 0
    (run,) = (tmp_path / "silo" / FEDERATION).iterdir()
    damaged = run / "silos" / "va" / "checkpoints" / "round-000002.ckpt"
    damaged.write_bytes(damaged.read_bytes()[:-7] + b"garbage")
    capsys.readouterr()
    resumed = tmp_path / "resumed.json"
    argv = ["run", JOB, "rounds=3", out, "--quiet", off, "--resume", run.name]
    assert main([*argv, "--results", str(resumed)]) == 0
    lines = capsys.readouterr().err.splitlines()
    warned = [line for line in lines if str(damaged) in line]
    assert len(warned) == 1 and warned[0].startswith(f"warning: checkpoint {damaged}: "), lines
    assert warned[0].endswith("; resuming from round 1"), warned
    at_once = tmp_path / "at_once.json"
    argv = ["run", JOB, "rounds=3", f"output_dir={tmp_path / 'once'}", "--quiet", off]
    assert main([*argv, "--results", str(at_once)]) == 0
    got, expected = (json.loads(p.read_text()) for p in (resumed, at_once))
    assert [h["round"] for h in got["history"]] == [1, 2, 3]
    for silo, figures in expected["silos"].items():
        assert got["silos"][silo]["test_accuracy"] == figures["test_accuracy"], silo
        assert got["silos"][silo]["val_accuracy"] == figures["val_accuracy"], silo

    # A run whose newest server checkpoint is cut short resumes from the round before it.
    out = f"output_dir={tmp_path / 'cut'}"
    assert main(["run", JOB, "rounds=2", out, "--quiet", "tracking.enabled=false"]) == 0
    (run,) = (tmp_path / "cut" / FEDERATION).iterdir()
    newest = run / "server" / "round-000002.ckpt"
    newest.write_bytes(newest.read_bytes()[:50])
    capsys.readouterr()
    argv = ["run", JOB, "rounds=3", out, "--quiet", "tracking.enabled=false", "--resume", run.name]
    assert main(argv) == 0
    lines = capsys.readouterr().err.splitlines()
    warned = [line for line in lines if str(newest) in line]
    assert len(warned) == 1 and warned[0].startswith("warning: checkpoint "), lines
    assert warned[0].endswith("; resuming from round 1"), warned
    result = json.loads((run / RESULT_FILE).read_text())
    assert [h["round"] for h in result["history"]] == [1, 2, 3]


def test_a_run_refused_at_load_makes_no_artifact_directory(tmp_path, capsys, mlflow_store):
    code = main(["run", JOB, f"output_dir={tmp_path / 'runs'}", "--resume"])
    assert code == 2 and capsys.readouterr().err.startswith("error: --resume: no run of ")
    assert not (tmp_path / "mlartifacts").exists() and not (tmp_path / "runs").exists()


def test_an_artifact_location_under_a_file_is_refused_naming_it(tmp_path):
    from silo_pfl.errors import ConfigError
    from silo_pfl.tracking.store import check_artifact_dir

    (tmp_path / "a_file").write_text("")
    with pytest.raises(ConfigError) as info:
        check_artifact_dir(str(tmp_path / "a_file" / "artifacts"), "tracking.uri")
    assert str(info.value) == (
        f"tracking.uri: artifact location {tmp_path}/a_file/artifacts cannot be created "
        f"({tmp_path}/a_file is not a directory)"
    )
    check_artifact_dir(str(tmp_path / "new" / "artifacts"), "tracking.uri")
    assert not (tmp_path / "new").exists()


@pytest.mark.slow
def test_a_round_a_silos_run_logged_before_the_driver_died_is_not_logged_again(
    ray_local, tmp_path, capsys, mlflow_store
):
    """The driver died after va's child run took round 3's batch and before the parent's
    (each run's batch goes in whole, one run after another): the resumed run redoes round 3
    and logs it on every run that lacks it, once; va's child run is not given it twice."""
    from mlflow.entities import Metric

    out = f"output_dir={tmp_path}"
    assert main(["run", JOB, "rounds=2", out, "--quiet"]) == 0
    (run,) = (tmp_path / FEDERATION).iterdir()
    client = MlflowClient(mlflow_store)
    parent = json.loads((run / RESULT_FILE).read_text())["mlflow"]["run_id"]
    experiment = client.get_run(parent).info.experiment_id
    children = {
        r.data.tags["silo"]: r.info.run_id
        for r in client.search_runs([experiment], f"tags.mlflow.parentRunId = '{parent}'")
    }
    client.log_batch(children["va"], metrics=[Metric("took_part", 1.0, 0, 3)], synchronous=True)
    capsys.readouterr()
    assert main(["run", JOB, "rounds=3", out, "--quiet", "--resume", run.name]) == 0
    for silo, child in children.items():
        steps = [m.step for m in client.get_metric_history(child, "took_part")]
        assert sorted(steps) == [1, 2, 3], (silo, steps)
    steps = [m.step for m in client.get_metric_history(parent, "round_seconds")]
    assert sorted(steps) == [1, 2, 3]
