"""A real multi-node Ray cluster on this machine: every silo on its own node, by label.

The cluster is the shared one of tests/loopback_cluster.py (the project's own
`cluster/local_cluster.py`: a head and one node per hospital labelled silo=<name>, token
authentication on); the federation joins it with ray.address or RAY_ADDRESS, as a user would.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from processes import stop_group

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SILOS = ("cleveland", "hungarian", "switzerland", "va")


@pytest.fixture
def cluster(loopback_cluster):
    """The shared cluster's info (address, head, nodes)."""
    return loopback_cluster.info


@pytest.fixture
def env(loopback_cluster):
    """What a client of the cluster needs: its token, RAY_AUTH_MODE=token; no RAY_ADDRESS."""
    return loopback_cluster.env


def _command(tmp_path: Path, address: str | None, *overrides: str) -> list[str]:
    """The CLI on the heart-disease job, per-node placement; address=None sets none."""
    joined = [f"ray.address={address}"] if address else []
    return [
        sys.executable,
        "-m",
        "silo_pfl.cli",
        "run",
        "jobs/heart_disease.yaml",
        *joined,
        "ray.placement=per_node",
        f"output_dir={tmp_path / 'runs'}",
        "tracking.enabled=false",
        *overrides,
    ]


def _run(
    tmp_path: Path, address: str | None, *overrides: str, env: dict[str, str]
) -> subprocess.CompletedProcess:
    """`_command` to its end."""
    return subprocess.run(
        _command(tmp_path, address, *overrides),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )


@pytest.fixture(scope="module")
def both_runs(loopback_cluster, tmp_path_factory) -> dict[str, dict]:
    """The whole job twice, side by side, while the cluster runs: joined to the cluster by
    RAY_ADDRESS (as a Ray Job's driver is), and with no address at all, on one local node. Each
    run's results."""
    base, env = tmp_path_factory.mktemp("both_runs"), loopback_cluster.env
    joined = {**env, "RAY_ADDRESS": loopback_cluster.info["address"]}
    runs = {
        "cluster": (_command(base / "c", None, "--results", str(base / "c.json")), joined),
        "single": (
            _command(base / "s", None, "ray.placement=any", "--results", str(base / "s.json")),
            env,
        ),
    }
    started = {
        name: subprocess.Popen(
            command,
            cwd=ROOT,
            env=run_env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for name, (command, run_env) in runs.items()
    }
    results = {}
    try:
        for name, proc in started.items():
            _, err = proc.communicate(timeout=600)
            assert proc.returncode == 0, f"{name}: {err[-2000:]}"
            results[name] = json.loads((base / f"{name[0]}.json").read_text())
    finally:
        for proc in started.values():
            stop_group(proc)
    return results


def test_no_address_starts_its_own_ray_rather_than_joining_a_running_cluster(cluster, both_runs):
    used = {silo["node_id"] for silo in both_runs["single"]["silos"].values()}
    cluster_nodes = {cluster["head"], *cluster["nodes"].values()}
    assert len(used) == 1
    assert not used & cluster_nodes


def test_the_four_hospitals_on_five_nodes_equal_the_single_node_run(cluster, both_runs):
    """The whole job joined by RAY_ADDRESS, each silo on its own node and the server on the
    head, and on one local node: the same seed gives the same accuracies and global model,
    wherever the silos run."""
    a, b = both_runs["cluster"], both_runs["single"]
    assert {s: a["silos"][s]["node_id"] for s in SILOS} == cluster["nodes"]
    assert len(set(cluster["nodes"].values())) == len(SILOS)
    assert a["server_node_id"] == cluster["head"]
    assert len({s["node_id"] for s in b["silos"].values()}) == 1
    for silo in SILOS:
        assert a["silos"][silo]["test_accuracy"] == pytest.approx(
            b["silos"][silo]["test_accuracy"], abs=1e-6
        )
    assert a["mean_test_accuracy"] == pytest.approx(b["mean_test_accuracy"], abs=1e-6)
    state_a, state_b = np.load(a["global_state_path"]), np.load(b["global_state_path"])
    assert set(state_a) == set(state_b)
    for key in state_a:
        np.testing.assert_allclose(state_a[key], state_b[key], rtol=0, atol=1e-6)


def test_a_silo_without_a_node_is_a_clear_error(cluster, env, tmp_path):
    good = tmp_path / "cleveland.csv"
    good.write_text("x,label\n" + "\n".join(f"{i},{i % 2}" for i in range(30)) + "\n")
    proc = _run(
        tmp_path,
        cluster["address"],
        "data.source=csv",
        "data.num_classes=2",
        f"data.paths.cleveland={good}",
        f"data.paths.nowhere={good}",
        env=env,
    )
    assert proc.returncode != 0
    err = proc.stderr.strip().splitlines()[-1]
    assert "Traceback" not in proc.stderr
    assert "silo nowhere" in err and "silo=nowhere" in err


def test_every_process_and_a_joining_driver_send_their_metrics_each_second(cluster, env):
    """cluster/local_cluster.py's --metrics-export-interval-s (default 1 s, not Ray's 10 s)
    reaches a driver that joins and the workers on the silos' nodes: a run's end waits that
    long (runtime/metrics.py, DriverMetrics.settle) for its last figures to be sent."""
    script = """
import json, ray
from silo_pfl.runtime.metrics import export_interval_s
ray.init(log_to_driver=False)

@ray.remote(num_cpus=0, label_selector={"silo": "va"})
def worker() -> int:
    return ray._config.metrics_report_interval_ms()

print(json.dumps([export_interval_s(), ray.get(worker.remote())]))
"""
    proc = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**env, "RAY_ADDRESS": cluster["address"]},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.splitlines()[-1]) == [1.0, 1000]


def test_auto_with_several_clusters_and_no_ray_start_of_ones_own_is_one_line(
    ray_local, cluster, env, tmp_path
):
    """The session's local Ray and the loopback cluster both run here, and this user's temp dir
    names neither (no `ray start` of theirs): Ray's "auto" would join either; the run asks for
    the address instead, in one line, before anything starts."""
    temp = tmp_path / "t"
    temp.mkdir()
    done = _run(tmp_path, "auto", "rounds=1", env={**env, "RAY_TMPDIR": str(temp)})
    assert done.returncode == 1, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith('error: ray.address: "auto" found '), line
    port = cluster["address"].rsplit(":", 1)[1]
    assert f":{port}" in line and "and no `ray start` of yours naming one;" in line, line
    assert line.endswith("give the head's GCS address, host:port (ray start --head --port)")
    assert not (tmp_path / "runs").exists()
