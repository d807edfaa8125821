"""privacy.central_models: what of the models reaches the central store, on a real local Ray
with a real MLflow store; the models kept by the silos load and serve from where they were put."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from mlflow import MlflowClient
from serving import predict, served

from silo_pfl.cli import main
from silo_pfl.data import load_silo_data
from silo_pfl.federation import Federation
from silo_pfl.settings import load_config

JOB = "jobs/heart_disease.yaml"
HOSPITALS = ("cleveland", "hungarian", "switzerland", "va")

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_local")]


def _artifacts(store: str) -> dict[str, Path]:
    """Every file the central store holds, by its path relative to the store's artifact root."""
    root = Path(store.removeprefix("sqlite:///")).parent / "mlartifacts"
    return {str(p.relative_to(root)): p for p in root.rglob("*") if p.is_file()}


def test_global_only_keeps_every_silo_model_and_statistic_out_of_the_central_store(
    tmp_path, mlflow_store, capsys
):
    overrides = [
        f"output_dir={tmp_path / 'runs'}",
        "rounds=3",
        "privacy.central_models=global_only",
    ]
    result = Federation(JOB, overrides).run()
    client = MlflowClient(mlflow_store)
    assert client.search_registered_models() == []
    files = _artifacts(mlflow_store)
    names = {Path(name).name for name in files}
    assert "global_state.npz" in names and "partition.json" not in names
    assert not any(name == "MLmodel" or name.endswith(".pt") for name in names)
    (npz,) = (p for n, p in files.items() if n.endswith("global_state.npz"))
    stored = set(np.load(npz).files)
    local = {k for k in stored if k.startswith("head.")}
    assert stored and not local  # FedPer's head never reaches the central store
    for path in files.values():
        if path.suffix in (".json", ".html"):
            text = path.read_text()
            assert "preprocessing" not in text and '"mean"' not in text, path
    # Each silo's model is in its own directory, listed, loads and serves from there.
    assert main(["models", "--local", str(tmp_path / "runs")]) == 0
    listed = capsys.readouterr().out
    cfg = load_config(JOB, overrides)
    import mlflow.pyfunc
    import pandas as pd

    for silo in HOSPITALS:
        where = Path(result.extras["mlflow"]["models"][silo])
        assert where.is_dir() and str(where) in listed
        data = load_silo_data(cfg.data, silo, cfg.seed)
        rows = pd.DataFrame(data.x_test_raw, columns=list(data.raw_columns))
        accuracy = float(np.mean(mlflow.pyfunc.load_model(str(where)).predict(rows) == data.y_test))
        assert accuracy == pytest.approx(result.silos[silo].test_accuracy, abs=0.005)
    va = Path(result.extras["mlflow"]["models"]["va"])
    data = load_silo_data(cfg.data, "va", cfg.seed)
    with served(str(va), mlflow_store, tmp_path / "serve.log") as url:
        served_predictions = predict(url, data.raw_columns, data.x_test_raw.tolist())
    assert float(np.mean(served_predictions == data.y_test)) == pytest.approx(
        result.silos["va"].test_accuracy, abs=0.005
    )
    example = json.loads((va / "input_example.json").read_text())
    real_rows = {tuple(row) for row in data.x_test_raw.tolist()}
    assert all(tuple(row) not in real_rows for row in example["data"])


def test_none_sends_no_model_at_all(tmp_path, mlflow_store, monkeypatch):
    job = Path(JOB).absolute()
    monkeypatch.chdir(tmp_path)  # a relative output_dir: the results name each model absolutely
    overrides = ["output_dir=runs", "rounds=2", "privacy.central_models=none"]
    result = Federation(job, overrides).run()
    names = {Path(name).name for name in _artifacts(mlflow_store)}
    assert "global_state.npz" not in names and "partition.json" not in names
    assert not any(name == "MLmodel" for name in names)
    client = MlflowClient(mlflow_store)
    run = client.get_run(result.extras["mlflow"]["run_id"])
    assert run.data.metrics["mean_test_accuracy"] == pytest.approx(result.mean_test_accuracy)
    models = result.extras["mlflow"]["models"].values()
    assert all(Path(uri).is_absolute() and Path(uri).is_dir() for uri in models)
