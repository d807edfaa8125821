"""A silo's registered model behind a real `mlflow models serve`, answering on raw rows."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from serving import predict, served

from silo_pfl.config import to_dict
from silo_pfl.server import Server
from silo_pfl.settings import load_config
from silo_pfl.silo import Silo
from silo_pfl.tracking.exporter import MlflowExporter


def _registered_silo(tmp_path: Path, store: str, silo: str) -> Silo:
    """Train one hospital for two rounds with the plain classes and register its model."""
    cfg = load_config(
        "jobs/heart_disease.yaml", [f"output_dir={tmp_path / 'runs'}", "round.min_silos=1"]
    )
    node = Silo(to_dict(cfg), silo)
    info = node.setup()
    node.build(info.input_shape, info.num_classes)
    server = Server(to_dict(cfg), info.input_shape, info.num_classes)
    node.attach({"mlflow": MlflowExporter(store, "tracking.uri", cfg.name, "-")})
    for round_ in (1, 2):
        update, _ = node.fit(server.global_state(), round_)
        assert server.aggregate(update).aggregated
        node.evaluate(server.global_state(), round_)
        node.commit(round_, keep=True)
    node.export()
    return node


def test_mlflow_models_serve_answers_raw_rows_with_the_reported_accuracy(tmp_path, mlflow_store):
    silo = _registered_silo(tmp_path, mlflow_store, "hungarian")
    # As a client writes them: integers where the raw values are whole (age 63, not 63.0).
    rows = [[int(v) if v.is_integer() else v for v in row] for row in silo.data.x_test_raw]
    model = "models:/heart_disease-hungarian@champion"
    with served(model, mlflow_store, tmp_path / "serve.log") as url:
        predictions = predict(url, silo.data.raw_columns, rows)
    assert predictions.shape == silo.data.y_test.shape
    accuracy = float(np.mean(predictions == silo.data.y_test))
    assert accuracy == pytest.approx(silo.outcome().test_accuracy, abs=0.005)
