"""MLflow tracking of real federations on a real local Ray, into SQLite stores under tmp_path."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import mlflow
import numpy as np
import pandas as pd
import pytest
from mlflow import MlflowClient
from session_ray import NODE_ONLY_VAR

from silo_pfl.cli import main
from silo_pfl.data import load_silo_data
from silo_pfl.federation import Federation
from silo_pfl.settings import load_config

pytestmark = pytest.mark.usefixtures("ray_local")

HOSPITALS = ["cleveland", "hungarian", "switzerland", "va"]
ROUND_METRICS = ("train_loss", "val_accuracy", "test_accuracy", "bytes_sent", "train_seconds")


def raw_test_accuracy(model_uri: str, silo: str) -> float:
    """Accuracy of a registered model on the hospital's raw test rows (10 raw columns)."""
    cfg = load_config("jobs/heart_disease.yaml")
    data = load_silo_data(cfg.data, silo, cfg.seed)
    rows = pd.DataFrame(data.x_test_raw, columns=list(data.raw_columns))
    predicted = mlflow.pyfunc.load_model(model_uri).predict(rows)
    return float(np.mean(predicted == data.y_test))


def test_heart_disease_registers_one_servable_model_per_hospital(
    tmp_path, mlflow_store, capsys, monkeypatch
):
    out = tmp_path / "results.json"
    args = ["run", "jobs/heart_disease.yaml", "rounds=3", f"output_dir={tmp_path / 'runs'}"]
    assert main([*args, "--results", str(out)]) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("mlflow: run ")]
    summary = json.loads(out.read_text())
    tracked = summary["mlflow"]
    assert tracked["tracking_uri"] == mlflow_store and tracked["experiment"] == "heart_disease"

    client = MlflowClient(mlflow_store)
    names = sorted(m.name for m in client.search_registered_models())
    assert names == [f"heart_disease-{h}" for h in HOSPITALS]
    parent = client.get_run(tracked["run_id"])
    children = {
        run.data.tags["silo"]: run
        for run in client.search_runs(
            [parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'"
        )
    }
    for hospital in HOSPITALS:
        name, reported = f"heart_disease-{hospital}", summary["silos"][hospital]
        champion = client.get_model_version_by_alias(name, "champion")
        assert client.get_model_version_by_alias(name, "latest").version == champion.version == 1
        assert tracked["models"][hospital] == f"models:/{name}/1"
        assert champion.tags["algorithm"] == "fedper"
        assert champion.tags["run_id"] == children[hospital].info.run_id
        assert int(champion.tags["round"]) == reported["selected_round"]
        assert float(champion.tags["test_accuracy"]) == reported["test_accuracy"]
        rows = load_silo_data(load_config("jobs/heart_disease.yaml").data, hospital, 0)
        assert champion.tags["val_rows"] == rows.validation_digest()
        delta = raw_test_accuracy(f"models:/{name}@champion", hospital) - reported["test_accuracy"]
        assert abs(delta) <= 0.005, (hospital, delta)

    assert parent.data.params["algorithm.name"] == "fedper" and parent.data.params["rounds"] == "3"
    for key in ("mean_test_accuracy", "worst_test_accuracy", "std_test_accuracy"):
        assert parent.data.metrics[key] == pytest.approx(summary[key])
    assert "wall_seconds" in parent.data.metrics
    for hospital, child in children.items():
        assert child.data.tags["node_id"] and child.data.tags["algorithm"] == "fedper"
        for key in ROUND_METRICS:
            history = client.get_metric_history(child.info.run_id, key)
            assert sorted(m.step for m in history) == [1, 2, 3], (hospital, key)
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"global_model", "split.json", "result.json"} <= artifacts
    assert (tmp_path / "mlartifacts" / "heart_disease").is_dir()

    capsys.readouterr()
    assert main(["models", "--federation", "heart_disease"]) == 0
    listing = capsys.readouterr().out.splitlines()
    assert len(listing) == 1 + len(HOSPITALS)
    assert all("champion,latest" in line and "@champion" in line for line in listing[1:])
    assert "val rows" in listing[0]
    for hospital in HOSPITALS:
        rows = load_silo_data(load_config("jobs/heart_disease.yaml").data, hospital, 0)
        (row,) = [x for x in listing[1:] if f"heart_disease-{hospital}@" in x]
        assert f" {rows.validation_digest()[:8]} " in row, row

    # The printed command lists the models from anywhere, whatever the environment's store.
    hint = shlex.split(line.split("; models: ")[1])
    assert hint[:2] == ["silo-pfl", "models"], line
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    monkeypatch.chdir(tmp_path.parent)
    assert main(hint[1:]) == 0
    listed = capsys.readouterr().out
    assert all(f"heart_disease-{h}" in listed for h in HOSPITALS), listed


@pytest.mark.parametrize(
    "overrides",
    [["algorithm.name=ditto"], ["model.adapter_dim=8", "split.local=[adapters]"]],
    ids=["ditto", "local-adapters"],
)
def test_personal_models_beyond_the_head_are_registered_and_served(
    tmp_path, mlflow_store, overrides
):
    """Ditto's personal model, and a model with local adapters, reproduce their accuracy."""
    cfg = load_config(
        "jobs/heart_disease.yaml", [*overrides, "rounds=3", f"output_dir={tmp_path / 'runs'}"]
    )
    result = Federation(cfg).run()
    for hospital in HOSPITALS:
        uri = f"models:/heart_disease-{hospital}@champion"
        reported = result.silos[hospital].test_accuracy
        assert abs(raw_test_accuracy(uri, hospital) - reported) <= 0.005, hospital


def test_silo_with_its_own_store_keeps_its_model_out_of_the_central_one(
    ray_local, tmp_path, job, monkeypatch
):
    """va's store is named with a variable of its node's environment, which the driver lacks:
    the silo fills it in, and the driver and the results keep the name."""
    central, own = tmp_path / "central" / "mlflow.db", tmp_path / "premises" / "mlflow.db"
    central.parent.mkdir()
    own.parent.mkdir()
    configured = f"sqlite:///{tmp_path}/${NODE_ONLY_VAR}/mlflow.db"
    monkeypatch.delenv(NODE_ONLY_VAR)  # the session's Ray, and so the silos, started with it
    result = Federation(
        job(
            "jobs/heart_disease.yaml",
            "rounds=2",
            f"tracking.uri=sqlite:///{central}",
            f"silos.va.tracking_uri={configured}",
        )
    ).run()
    others = [h for h in HOSPITALS if h != "va"]
    central_client, own_client = (
        MlflowClient(f"sqlite:///{central}"),
        MlflowClient(f"sqlite:///{own}"),
    )
    assert sorted(m.name for m in central_client.search_registered_models()) == [
        f"heart_disease-{h}" for h in others
    ]
    assert [m.name for m in own_client.search_registered_models()] == ["heart_disease-va"]
    experiment = central_client.get_experiment_by_name("heart_disease").experiment_id
    logged = central_client.search_logged_models(experiment_ids=[experiment])
    assert sorted(m.tags["silo"] for m in logged) == others
    assert len(list((central.parent / "mlartifacts" / "heart_disease" / "models").iterdir())) == 3
    va_run = central_client.search_runs([experiment], "tags.silo = 'va'")[0]
    assert va_run.data.tags["model_store"] == "silo" and va_run.outputs.model_outputs == []
    assert len(central_client.get_metric_history(va_run.info.run_id, "val_accuracy")) == 2

    tracked = result.extras["mlflow"]
    assert tracked["models"]["va"] == "models:/heart_disease-va/1"
    assert tracked["silo_tracking_uris"] == {"va": configured}
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{own}")
    accuracy = raw_test_accuracy("models:/heart_disease-va@champion", "va")
    assert accuracy == pytest.approx(result.silos["va"].test_accuracy, abs=0.005)


def test_tracking_disabled_writes_no_store(tmp_path, capsys):
    out = tmp_path / "results.json"
    args = ["run", "jobs/heart_disease.yaml", "rounds=2", "tracking.enabled=false"]
    assert main([*args, f"output_dir={tmp_path / 'runs'}", "--results", str(out)]) == 0
    assert "mlflow" not in capsys.readouterr().out
    assert "mlflow" not in json.loads(out.read_text())
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "mlartifacts").exists()


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("silos.va.tracking_uri=sqlite:///{tmp}/nowhere/mlflow.db", "silos.va.tracking_uri"),
        (
            "silos.va.tracking_uri=sqlite:///{tmp}/$SILO_PFL_ON_NO_NODE/mlflow.db",
            "error: silos.va.tracking_uri: environment variable SILO_PFL_ON_NO_NODE is not set on "
            "silo va's node; set it where its own node's `ray start` runs",
        ),
        (
            "silos.va.tracking_uri=sqlite:///{tmp}/pa$SILO_PFL_WORD/mlflow.db",
            "A literal $ in the URI (in a password, say) is written %24, as URIs escape it",
        ),
        ("tracking.uri=postgresql://nobody@127.0.0.1:1/db", "cannot open the MLflow store"),
    ],
)
def test_store_errors_found_after_start_up_are_one_line_before_round_one(
    tmp_path, capsys, override, expected
):
    """Checks that need MLflow or the silo's node run while Ray starts; they end the run early."""
    args = ["run", "jobs/heart_disease.yaml", "rounds=2", f"output_dir={tmp_path / 'runs'}"]
    code = main([*args, override.format(tmp=tmp_path)])
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert code != 0
    assert err.count("\n") == 0 and "Traceback" not in err
    assert expected in err
    assert "round 1" not in captured.out


def test_a_resume_with_more_rounds_is_what_the_report_reads_back(tmp_path, mlflow_store, job):
    """`--resume rounds=2` of a 1-round run: the parent run's `rounds` tag says 2 (its param,
    which MLflow never changes, still says 1), so `silo-pfl report` rebuilds the page the run
    wrote as it ended, byte for byte; a run from before the tag reads the param."""
    from silo_pfl.report.data import read_run

    first = Federation(job("jobs/heart_disease.yaml", "rounds=1")).run()
    resumed = Federation(job("jobs/heart_disease.yaml", "rounds=2")).run(resume=True)
    run_id = resumed.extras["mlflow"]["run_id"]
    assert run_id == first.extras["mlflow"]["run_id"] and len(resumed.history) == 2
    out = tmp_path / "read_back"
    assert main(["report", run_id, "--out", str(out), "--no-log"]) == 0
    written = Path(resumed.run_dir) / "report" / "report.html"
    assert (out / "report.html").read_bytes() == written.read_bytes()
    client = MlflowClient(mlflow_store)
    assert client.get_run(run_id).data.params["rounds"] == "1"
    assert read_run(client, run_id).rounds == 2
    client.delete_tag(run_id, "rounds")  # as a run logged before the tag
    assert read_run(client, run_id).rounds == 1
