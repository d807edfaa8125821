"""A silo's registered model behind a real `mlflow models serve`, answering on raw rows."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from silo_pfl.config import load_config, to_dict
from silo_pfl.server import Server
from silo_pfl.silo import Silo
from silo_pfl.tracking.exporter import MlflowExporter

STARTUP_SECONDS = 180


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _registered_silo(tmp_path: Path, store: str, silo: str) -> Silo:
    """Train one hospital for two rounds with the plain classes and register its model."""
    cfg = load_config("jobs/heart_disease.yaml", [f"output_dir={tmp_path / 'runs'}"])
    node = Silo(to_dict(cfg), silo)
    info = node.setup()
    node.build(info.input_shape, info.num_classes)
    server = Server(to_dict(cfg), info.input_shape, info.num_classes)
    node.attach({"mlflow": MlflowExporter(store, "tracking.uri", cfg.name, "-")})
    for round_ in (1, 2):
        update, _ = node.fit(server.global_state(), round_)
        node.evaluate(server.aggregate(update), round_)
        node.keep(round_)
    node.export()
    return node


def _wait_for_ping(url: str, server: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + STARTUP_SECONDS
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"mlflow models serve exited with {server.returncode}: {log.read_text()}")
        try:
            with urllib.request.urlopen(f"{url}/ping", timeout=2) as answer:
                if answer.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            time.sleep(0.5)
    pytest.fail(f"mlflow models serve did not answer /ping in {STARTUP_SECONDS} s")


def _stop(server: subprocess.Popen) -> None:
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def test_mlflow_models_serve_answers_raw_rows_with_the_reported_accuracy(tmp_path, mlflow_store):
    silo = _registered_silo(tmp_path, mlflow_store, "hungarian")
    port, log = _free_port(), tmp_path / "serve.log"
    mlflow_cli = Path(sys.executable).with_name("mlflow")
    command = [str(mlflow_cli), "models", "serve", "-m", "models:/heart_disease-hungarian@champion"]
    command += ["--env-manager", "local", "--host", "127.0.0.1", "--port", str(port)]
    # As in an activated venv: the server runs `uvicorn` from the venv's bin directory.
    path = f"{mlflow_cli.parent}{os.pathsep}{os.environ.get('PATH', '')}"
    env = {**os.environ, "MLFLOW_TRACKING_URI": mlflow_store, "PATH": path}
    with log.open("w") as out:
        server = subprocess.Popen(
            command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_for_ping(url, server, log)
        # As a client writes them: integers where the raw values are whole (age 63, not 63.0).
        rows = [[int(v) if v.is_integer() else v for v in row] for row in silo.data.x_test_raw]
        body = {"dataframe_split": {"columns": list(silo.data.raw_columns), "data": rows}}
        request = urllib.request.Request(
            f"{url}/invocations",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as answer:
            predictions = np.asarray(json.loads(answer.read())["predictions"])
    finally:
        _stop(server)
    assert predictions.shape == silo.data.y_test.shape
    accuracy = float(np.mean(predictions == silo.data.y_test))
    assert accuracy == pytest.approx(silo.outcome().test_accuracy, abs=0.005)
