"""The privacy invariant, by canaries: distinctive values planted in every local tensor at every
round, in a raw data row, in a cell, in another silo's settings and in a store's password, then
looked for in every byte that leaves a silo, in every form (text, float64, float32, float16).

- In one process (no Ray): everything a silo returns (what Ray would carry: setup, build, fit,
  evaluate, commit, outcome, export) and its errors.
- On a real local Ray with a real MLflow server: the central store (its database and artifacts),
  the results JSON, the run's directory outside the silos' (server checkpoints, history, report,
  run.json), the driver's log and the silo workers' logs, the model each silo keeps, and
  the config each silo's process was given.
A canary may appear only where the configuration allows it (README, "What leaves a silo").
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from processes import stop_group, wait_for_http
from serving import free_port
from sklearn.datasets import load_breast_cancer

from silo_pfl.callbacks import Callback
from silo_pfl.config import to_dict
from silo_pfl.errors import DataError
from silo_pfl.federation import Federation
from silo_pfl.server_start import new_server
from silo_pfl.settings import load_config
from silo_pfl.silo import Silo
from silo_pfl.tracking.exporter import LocalExporter
from tests.canary_plugins import MARKER

ROUNDS = 3
SILOS = ("alpha", "beta", "gamma")
PASSWORD = "CanaryPass42"  # the central store's password
BETA_PATH = "CANARY-PATH-beta"  # a directory in beta's data path: beta's own business
BETA_STORE = "CANARY-STORE-beta"  # a directory in beta's own store's path
RAW = 9000.0625 + np.arange(30)  # alpha's canary row; most of alpha's rows are this row
BAD_CELL = "CANARY-CELL-7731"


def _write_silos(root: Path) -> dict[str, Path]:
    """Three hospitals' CSV files from scikit-learn's breast cancer data; alpha's rows are
    mostly one canary row (so that any statistic of a column, such as a median, is that row)."""
    data = load_breast_cancer()
    columns = [f"f{i}" for i in range(data.data.shape[1])]
    parts = np.array_split(np.arange(len(data.target)), 3)
    paths = {}
    for name, rows in zip(SILOS, parts, strict=True):
        x, y = data.data[rows[:60]], data.target[rows[:60]]
        if name == "alpha":
            x = np.vstack([x, np.tile(RAW, (140, 1))])
            y = np.concatenate([y, np.arange(140) % 2])
        folder = root / (BETA_PATH if name == "beta" else name)
        folder.mkdir(parents=True)
        lines = [",".join([*columns, "label"])]
        lines += [
            ",".join([*(repr(float(v)) for v in row), str(int(t))])
            for row, t in zip(x, y, strict=True)
        ]
        paths[name] = folder / f"{name}.csv"
        paths[name].write_text("\n".join(lines) + "\n")
    return paths


def _job(root: Path, paths: dict[str, Path]) -> Path:
    job = root / "canary.yaml"
    lines = ["name: canary", f"rounds: {ROUNDS}", "model: {name: mlp, hidden: [16]}", "data:"]
    lines += ["  source: csv", "  num_classes: 2", "  paths:"]
    lines += [f"    {name}: {path}" for name, path in paths.items()]
    lines += ["algorithm: {name: canary}", "plugins: [tests.canary_plugins]"]
    job.write_text("\n".join(lines) + "\n")
    return job


def _patterns(markers: bool = True) -> dict[str, list[bytes]]:
    """Each canary's byte forms: its text, runs of it as float64, float32 and float16, and a
    local tensor's value alone (a float64 either way round, a float32)."""
    found: dict[str, list[bytes]] = {
        "secret": [PASSWORD.encode()],
        "beta's data path": [BETA_PATH.encode()],
        "beta's store": [BETA_STORE.encode()],
        "a cell": [BAD_CELL.encode()],
        "the raw row": [],
    }
    for value in RAW[:3]:
        found["the raw row"].append(repr(float(value)).encode())
    for dtype in (np.float64, np.float32, np.float16):
        found["the raw row"].append(RAW[:4].astype(dtype).tobytes())
    if markers:
        found["a local tensor"] = []
        for round_ in range(1, ROUNDS + 1):
            value = MARKER + round_
            found["a local tensor"].append(repr(value).encode())
            for dtype in (np.float64, np.float32, np.float16):
                found["a local tensor"].append(np.full(4, value, dtype=dtype).tobytes())
            for dtype in ("<f8", ">f8", "<f4"):  # one value: a number, as pickle writes it
                found["a local tensor"].append(np.array(value, dtype=dtype).tobytes())
    return found


def _leaks(blob: bytes, allowed: set[str] = frozenset(), markers: bool = True) -> list[str]:
    """The canaries (not in `allowed`) whose byte forms occur in `blob`."""
    return sorted(
        what
        for what, forms in _patterns(markers).items()
        if what not in allowed and any(form in blob for form in forms)
    )


def test_nothing_a_silo_returns_holds_a_canary(tmp_path):
    """Every object a silo hands back, pickled as Ray pickles it, over three rounds."""
    paths = _write_silos(tmp_path / "data")
    config = to_dict(load_config(str(_job(tmp_path, paths)), [f"output_dir={tmp_path / 'runs'}"]))
    silos = [Silo(config, name) for name in SILOS]
    handed_out = [silo.setup() for silo in silos]
    shape, classes = handed_out[0].input_shape, handed_out[0].num_classes
    handed_out += [silo.build(shape, classes) for silo in silos]
    server = new_server(config, shape, classes)
    for silo in silos:
        silo.attach({"local": LocalExporter()})
    for round_ in range(1, ROUNDS + 1):
        fits = [silo.fit(server.global_state(), round_) for silo in silos]
        handed_out += fits
        assert server.aggregate(*[update for update, _ in fits]).aggregated
        handed_out += [silo.evaluate(server.global_state(), round_) for silo in silos]
        handed_out += [silo.commit(round_, True) for silo in silos]
    handed_out += [silo.outcome() for silo in silos]
    receipts = [silo.export() for silo in silos]
    handed_out += receipts
    for receipt in receipts:  # the model a silo keeps and serves: its own local layers only
        files = [p for p in Path(receipt["local"]["model_uri"]).rglob("*") if p.is_file()]
        assert files
        for path in files:
            assert _leaks(path.read_bytes(), allowed={"a local tensor"}) == [], path
    local = silos[0].model.state_dict()[silos[0].split.local_keys[0]]
    assert float(local.flatten()[0]) == MARKER + ROUNDS  # the canary is really there
    for item in handed_out:
        assert _leaks(pickle.dumps(item)) == [], item
    # An error about a silo's file names the cell, never quotes it.
    text = paths["gamma"].read_text().splitlines()
    text[5] = ",".join([BAD_CELL, *text[5].split(",")[1:]])
    paths["gamma"].write_text("\n".join(text) + "\n")
    with pytest.raises(DataError) as error:
        Silo(config, "gamma").setup()
    assert "column 'f0', data row 5" in str(error.value)
    assert _leaks(str(error.value).encode()) == []


class PidsOf(Callback):
    """Records the silos' process ids, to find their workers' logs."""

    def on_start(self, config, silos, split) -> None:
        self.pids = {info.pid for info in silos}


@pytest.fixture
def mlflow_server(tmp_path):
    """A real `mlflow server` (SQLite store, artifacts served from a directory) whose URI holds a
    password, as a production store's would; MLflow sends it and the server ignores it."""
    port = free_port()
    store, artifacts = tmp_path / "central.db", tmp_path / "central-artifacts"
    command = [str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1"]
    command += ["--port", str(port), "--backend-store-uri", f"sqlite:///{store}"]
    command += ["--artifacts-destination", str(artifacts), "--workers", "1"]
    log = tmp_path / "mlflow-server.log"
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}  # as tracking_server.sh
    with log.open("w") as out:
        server = subprocess.Popen(
            command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        wait_for_http(f"http://127.0.0.1:{port}/health", server, log, "mlflow server", 120)
        yield f"http://canary:{PASSWORD}@127.0.0.1:{port}", store, artifacts
    finally:
        stop_group(server)


@pytest.mark.slow
@pytest.mark.usefixtures("ray_local")
def test_no_canary_leaves_a_silo_on_ray_with_mlflow(tmp_path, mlflow_server, caplog):
    uri, store, artifacts = mlflow_server
    paths = _write_silos(tmp_path / "data")
    received = tmp_path / "received"
    received.mkdir()
    beta_store = tmp_path / BETA_STORE
    beta_store.mkdir()
    overrides = [
        f"output_dir={tmp_path / 'runs'}",
        f"tracking.uri={uri}",
        f"silos.beta.tracking_uri=sqlite:///{beta_store / 'beta.db'}",
        "privacy.central_models=global_only",
        "ray.silos_per_worker=1",
        f"algorithm.canary.received={received}",
    ]
    caplog.set_level(logging.INFO)
    pids = PidsOf()
    result = Federation(str(_job(tmp_path, paths)), overrides, [pids]).run()
    assert len(result.history) == ROUNDS
    # The central store: its database (params, metrics, tags) and every artifact.
    central = [store, *(p for p in artifacts.rglob("*") if p.is_file())]
    assert len(central) > 3
    for path in central:  # where beta keeps its models is in the run's params (as configured)
        assert _leaks(path.read_bytes(), allowed={"beta's store"}) == [], path
    # What the driver prints and logs, and the results JSON.
    assert _leaks(caplog.text.encode()) == []
    results = [json.dumps(result.to_dict(), default=str).encode()]
    results.append((Path(result.run_dir) / "result.json").read_bytes())
    for text in results:
        assert _leaks(text, allowed={"beta's store"}) == []
    # The run's directory but the silos' own: the server's checkpoints, global state and history,
    # the run's record and its report.
    run_dir = Path(result.run_dir)
    outside = [
        path
        for path in run_dir.rglob("*")
        if path.is_file() and path.relative_to(run_dir).parts[0] != "silos"
    ]
    assert {p.relative_to(run_dir).parts[0] for p in outside} >= {"server", "report", "run.json"}
    config = {"beta's data path", "beta's store", "secret"}  # run.json: the driver's own config
    for path in outside:
        allowed = config if path.name == "run.json" else {"beta's store"}
        assert _leaks(path.read_bytes(), allowed=allowed) == [], path
    # The silo workers' logs, found by their processes' ids.
    import ray

    logs = Path(ray._private.worker._global_node.get_logs_dir_path())
    worker_logs = [
        log
        for log in logs.glob("worker-*")
        if any(log.name.endswith((f"-{pid}.out", f"-{pid}.err")) for pid in pids.pids)
    ]
    assert len(worker_logs) >= len(SILOS)
    for log in worker_logs:
        assert _leaks(log.read_bytes()) == [], log
    # The model each silo keeps (and serves): its own local layers, nothing else's.
    for name in ("alpha", "gamma"):
        model = Path(result.extras["mlflow"]["models"][name])
        for path in (p for p in model.rglob("*") if p.is_file()):
            assert _leaks(path.read_bytes(), allowed={"a local tensor"}) == [], path
    # The config a silo's process holds: beta's settings only in beta's.
    for name in SILOS:
        held = (received / f"{name}.json").read_bytes()
        allowed = {"beta's data path", "beta's store", "secret"} if name == "beta" else {"secret"}
        assert _leaks(held, allowed, markers=False) == [], name
