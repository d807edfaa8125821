"""A real multi-node Ray cluster on this machine: every silo on its own node, by placement.

The cluster is the project's own `cluster/local_cluster.py` (one node per silo, each offering
the resource silo_<name>); the federation joins it with ray.address, as a user would.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SILOS = ("cleveland", "hungarian", "switzerland", "va")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Start head + one node per hospital; yield its info; stop only those nodes."""
    info_file = tmp_path_factory.mktemp("cluster") / "cluster.json"
    proc = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "cluster" / "local_cluster.py"),
            *SILOS,
            "--info-file",
            str(info_file),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 180
    while not (info_file.exists() and info_file.read_text().strip()):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail("cluster/local_cluster.py did not come up")
        time.sleep(0.5)
    yield json.loads(info_file.read_text())
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def _run(
    tmp_path: Path, address: str | None, *overrides: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """The CLI on the heart-disease job, 2 rounds, per-node placement; address=None sets none."""
    joined = [f"ray.address={address}"] if address else []
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "silo_pfl.cli",
            "run",
            "jobs/heart_disease.yaml",
            "rounds=2",
            *joined,
            "ray.placement=per_node",
            f"output_dir={tmp_path / 'runs'}",
            "tracking.enabled=false",
            *overrides,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )


@pytest.mark.parametrize("joined_by", ["ray.address", "RAY_ADDRESS"])
def test_each_silo_runs_on_its_own_node(cluster, tmp_path, joined_by):
    """Joined by the config key, or (as a Ray Job's driver is) by the RAY_ADDRESS variable."""
    results = tmp_path / "results.json"
    if joined_by == "ray.address":
        proc = _run(tmp_path, cluster["address"], "--results", str(results))
    else:
        env = {**os.environ, "RAY_ADDRESS": cluster["address"]}
        proc = _run(tmp_path, None, "--results", str(results), env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    silos = json.loads(results.read_text())["silos"]
    placed = {name: silos[name]["node_id"] for name in SILOS}
    assert placed == cluster["nodes"]
    assert len(set(placed.values())) == len(SILOS)
    assert cluster["head"] not in placed.values()


def test_a_silo_without_a_node_is_a_clear_error(cluster, tmp_path):
    good = tmp_path / "cleveland.csv"
    good.write_text("x,label\n" + "\n".join(f"{i},{i % 2}" for i in range(30)) + "\n")
    proc = _run(
        tmp_path,
        cluster["address"],
        "data.source=csv",
        f"data.paths.cleveland={good}",
        f"data.paths.nowhere={good}",
    )
    assert proc.returncode != 0
    err = proc.stderr.strip().splitlines()[-1]
    assert "Traceback" not in proc.stderr
    assert "silo nowhere" in err and "silo_nowhere" in err


def test_no_address_starts_its_own_ray_rather_than_joining_a_running_cluster(cluster, tmp_path):
    results = tmp_path / "results.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "silo_pfl.cli",
            "run",
            "jobs/heart_disease.yaml",
            "rounds=1",
            "ray.num_cpus=2",
            f"output_dir={tmp_path / 'runs'}",
            "tracking.enabled=false",
            "--results",
            str(results),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    used = {silo["node_id"] for silo in json.loads(results.read_text())["silos"].values()}
    cluster_nodes = {cluster["head"], *cluster["nodes"].values()}
    assert len(used) == 1
    assert not used & cluster_nodes
