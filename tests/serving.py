"""A real `mlflow models serve` for tests: register a silo's model, serve it, ask it for
predictions, stop it."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np
from loopback_cluster import cluster_script
from processes import stop_group, wait_for_http

if TYPE_CHECKING:
    from silo_pfl.silo import Silo

STARTUP_SECONDS = 180
BIN = Path(sys.executable).parent


@functools.cache
def _local_cluster() -> ModuleType:
    """cluster/local_cluster.py, loaded once for every port this module hands out."""
    return cluster_script("local_cluster")


def free_port() -> int:
    """A port for a server to come: the cluster's own choice, out of outgoing connections' way."""
    return _local_cluster().free_ports(1)[0]


def registered_silo(
    tmp_path: Path, store: str, silo: str, job: str = "jobs/heart_disease.yaml", *overrides: str
) -> Silo:
    """Train one silo for two rounds with the plain classes and register its model in `store`.
    (Imported here: the modules that only want a port or a server need no torch.)"""
    from silo_pfl.config import to_dict
    from silo_pfl.server_start import new_server
    from silo_pfl.settings import load_config
    from silo_pfl.silo import Silo
    from silo_pfl.tracking.exporter import MlflowExporter

    cfg = load_config(job, [f"output_dir={tmp_path / 'runs'}", "round.min_silos=1", *overrides])
    node = Silo(to_dict(cfg), silo)
    info = node.setup()
    node.build(info.input_shape, info.num_classes)
    server = new_server(to_dict(cfg), info.input_shape, info.num_classes)
    node.attach({"mlflow": MlflowExporter(store, "tracking.uri", cfg.name, "-")})
    for round_ in (1, 2):
        update, _ = node.fit(server.global_state(), round_)
        assert server.aggregate(update).aggregated
        node.evaluate(server.global_state(), round_)
        node.commit(round_, keep=True)
    node.export()
    return node


@contextlib.contextmanager
def served(model_uri: str, tracking_uri: str, log: Path) -> Iterator[str]:
    """`mlflow models serve -m model_uri` on a free port; yields its URL, then stops its group."""
    port = free_port()
    command = [str(BIN / "mlflow"), "models", "serve", "-m", model_uri, "--env-manager", "local"]
    command += ["--host", "127.0.0.1", "--port", str(port)]
    # As in an activated venv: the server runs `uvicorn` from the venv's bin directory.
    path = f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"
    env = {**os.environ, "MLFLOW_TRACKING_URI": tracking_uri, "PATH": path}
    with log.open("w") as out:
        server = subprocess.Popen(
            command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for_http(f"{url}/ping", server, log, "mlflow models serve", STARTUP_SECONDS)
        yield url
    finally:
        stop_group(server)


def predict(url: str, columns: Sequence[str], rows: list[list[float]]) -> np.ndarray:
    """POST raw rows to /invocations as a dataframe_split; the predictions."""
    body = {"dataframe_split": {"columns": list(columns), "data": rows}}
    request = urllib.request.Request(
        f"{url}/invocations",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as answer:
        return np.asarray(json.loads(answer.read())["predictions"])


def post(
    url: str, columns: Sequence[str], rows: list[list[Any]], params: dict[str, Any] | None = None
) -> tuple[int, dict[str, Any]]:
    """POST raw rows (and params) to /invocations; the HTTP status and the JSON answer, error or
    not."""
    body: dict[str, Any] = {"dataframe_split": {"columns": list(columns), "data": rows}}
    if params is not None:
        body["params"] = params
    request = urllib.request.Request(
        f"{url}/invocations",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())
