"""One real multi-node Ray cluster on loopback, shared by the tests that need one.

`cluster/local_cluster.py` (the project's own script) starts it with `ray start`: a head and a
node per hospital labelled silo=<name>, token authentication on with a token of its own, an
MLflow tracking server (--serve-artifacts) beside it, and each hospital's rows in a directory
that only its node names as $SILO_PFL_DATA_DIR. At the end it must stop cleanly and leave no
process it started.
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
HOSPITALS = ("cleveland", "hungarian", "switzerland", "va")
STARTUP_SECONDS = 240
CLIENT_VARS = ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "MLFLOW_TRACKING_URI", "RAY_AUTH_TOKEN")


def cluster_script(name: str) -> ModuleType:
    """A script of cluster/, imported from its path (cluster/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "cluster" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def stop_group(proc: subprocess.Popen, timeout: float, signum: int = signal.SIGTERM) -> None:
    """`signum` to a process we started in its own session; SIGKILL its group if it lingers."""
    if proc.poll() is None:
        proc.send_signal(signum)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def start(
    base: Path,
    hospitals: tuple[str, ...] = HOSPITALS,
    options: tuple[str, ...] = ("--tracking-server",),
    stop_signal: int = signal.SIGTERM,
) -> Iterator[SimpleNamespace]:
    """Start the cluster under `base`, a node per hospital (with its rows) and the head, with
    local_cluster.py's `options`; yield info, the clients' env, base, the script's process and
    its info file; then stop it with `stop_signal`, which must end it cleanly."""
    hospital_data = cluster_script("hospital_data")
    for hospital in hospitals:
        hospital_data.write_hospital(base / "nodes", hospital)
    env = {k: v for k, v in os.environ.items() if k not in CLIENT_VARS}
    env["RAY_AUTH_TOKEN"] = secrets.token_hex(32)  # ~/.ray/auth_token is left alone
    info_file, errors = base / "cluster.json", base / "cluster.err"
    command = [sys.executable, str(ROOT / "cluster" / "local_cluster.py"), *hospitals]
    command += [*options, "--data-root", str(base / "nodes")]
    command += ["--info-file", str(info_file)]
    proc = subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=errors.open("w"),
        start_new_session=True,
    )
    deadline = time.monotonic() + STARTUP_SECONDS
    while not (info_file.exists() and info_file.read_text().strip()):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_group(proc, 60)
            pytest.fail(f"local_cluster.py did not come up: {errors.read_text()[-2000:]}")
        time.sleep(0.5)
    info = json.loads(info_file.read_text())
    yield SimpleNamespace(
        info=info, env={**env, **info["env"]}, base=base, proc=proc, info_file=info_file
    )
    stop_group(proc, 90, stop_signal)
    assert proc.returncode == 0, errors.read_text()[-2000:]
    assert cluster_script("local_cluster")._processes_marked(info["marker"]) == []
