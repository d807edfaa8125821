"""A silo's registered model behind a real `mlflow models serve`, answering on raw rows: a
heart-disease hospital's MLP and a digits silo's CNN (tests/test_csv_federation.py serves a CSV
silo's)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from serving import predict, registered_silo, served

from silo_pfl.silo import init_model


def test_mlflow_models_serve_answers_raw_rows_with_the_reported_accuracy(tmp_path, mlflow_store):
    silo = registered_silo(tmp_path, mlflow_store, "hungarian")
    # As a client writes them: integers where the raw values are whole (age 63, not 63.0).
    rows = [[int(v) if v.is_integer() else v for v in row] for row in silo.data.x_test_raw]
    model = "models:/heart_disease-hungarian@champion"
    with served(model, mlflow_store, tmp_path / "serve.log") as url:
        predictions = predict(url, silo.data.raw_columns, rows)
    assert predictions.shape == silo.data.y_test.shape
    accuracy = float(np.mean(predictions == silo.data.y_test))
    assert accuracy == pytest.approx(silo.outcome().test_accuracy, abs=0.005)


def test_a_digits_silos_served_model_predicts_as_its_selected_model_on_raw_pixels(
    tmp_path, mlflow_store
):
    """FedBN on feature-shifted digits: the served CNN keeps the silo's own BatchNorm statistics
    and answers on the silo's own (shifted) images, pixel_0..pixel_63, as the model it selected
    does on its test inputs."""
    silo = registered_silo(
        tmp_path, mlflow_store, "silo_3", "jobs/digits_feature_shift.yaml", "data.num_silos=4"
    )
    assert silo.data.raw_columns == tuple(f"pixel_{i}" for i in range(64))
    assert any(".running_mean" in key for key in silo.split.local_keys)
    model = init_model(silo.cfg, silo.data.input_shape, silo.num_classes)
    model.load_state_dict(torch.load(silo.selected_path, weights_only=True))
    model.eval()
    with torch.no_grad():
        local = model(silo.test_xy[0]).argmax(dim=1).numpy()
    accuracy = float(np.mean(local == silo.data.y_test))
    assert accuracy == silo.outcome().test_accuracy > 0.5  # ten classes: chance is 0.1

    with served(
        "models:/digits_feature_shift-silo_3@champion", mlflow_store, tmp_path / "s.log"
    ) as url:
        predictions = predict(url, silo.data.raw_columns, silo.data.x_test_raw.tolist())
    assert predictions.shape == silo.data.y_test.shape
    np.testing.assert_array_equal(predictions, local)
