"""Placement by Ray node label: which label each actor needs, checked against the live nodes,
and on a real loopback cluster, the CPUs a pinned silo reserves against its labelled nodes'."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from loopback_cluster import cluster_script, start

from silo_pfl.errors import FederationError
from silo_pfl.runtime.placement import (
    HEAD_RESOURCE,
    actor_options,
    check_labels,
    server_selector,
    silo_selector,
)

ROOT = Path(__file__).resolve().parents[1]
JOB = "jobs/heart_disease.yaml"


def test_per_node_pins_each_silo_to_its_label_unless_it_names_its_own(job):
    cfg = job(JOB, "ray.placement=per_node", "silos.va.node_label.site=long-beach")
    assert silo_selector(cfg, "cleveland") == {"silo": "cleveland"}
    assert silo_selector(cfg, "va") == {"site": "long-beach"}
    assert server_selector(cfg) is None
    assert actor_options(server_selector(cfg), on_head=True) == {
        "resources": {HEAD_RESOURCE: 0.001}
    }
    assert actor_options(silo_selector(cfg, "va")) == {"label_selector": {"site": "long-beach"}}


def test_placement_any_leaves_silos_free_but_honours_explicit_labels(job):
    cfg = job(JOB, "silos.va.node_label.silo=va", "server.node_label.zone=dmz")
    assert silo_selector(cfg, "cleveland") is None
    assert actor_options(silo_selector(cfg, "cleveland")) == {}
    assert silo_selector(cfg, "va") == {"silo": "va"}
    assert actor_options(server_selector(cfg), on_head=False) == {"label_selector": {"zone": "dmz"}}


def test_a_label_no_live_node_carries_is_one_line_naming_the_actor(ray_local):
    node = ray_local.get_runtime_context().get_node_id()
    check_labels({"silo a": {"ray.io/node-id": node}, "silo b": None}, wait=1)
    began = time.monotonic()
    with pytest.raises(FederationError) as info:
        check_labels({"silo a": {"ray.io/node-id": node}, "silo b": {"silo": "b"}}, wait=1)
    assert time.monotonic() - began < 5
    message = str(info.value)
    assert message.startswith("silo b: no live Ray node carries the label silo=b")
    assert "ray start --labels=silo=b" in message and "\n" not in message


@pytest.fixture(scope="module")
def one_silo_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    """A real two-node cluster on loopback (cluster/local_cluster.py): the head and one 1-CPU
    node labelled silo=cleveland, token authentication on; its info, the clients' env, the
    script's process and its info file. A hangup (SIGHUP) stops it, and must leave nothing."""
    base = tmp_path_factory.mktemp("one_silo_cluster")
    yield from start(base, ("cleveland",), ("--cpus-per-node", "1"), signal.SIGHUP)


@pytest.mark.slow
def test_more_cpus_than_a_silos_labelled_node_has_is_one_line_at_once(one_silo_cluster, tmp_path):
    """per_node on a cluster: silo cleveland may run only on its 1-CPU node, so ray.silo_cpus=2
    can never be met; the run says so at once rather than after round.call_timeout_s."""
    argv = [sys.executable, "-m", "silo_pfl", "run", JOB, "rounds=1", "tracking.enabled=false"]
    argv += [f"output_dir={tmp_path / 'runs'}", f"ray.address={one_silo_cluster.info['address']}"]
    argv += ["ray.placement=per_node", "data.late_silos=[hungarian,switzerland,va]"]
    argv += ["round.call_timeout_s=60", "ray.silo_cpus=2"]
    began = time.monotonic()
    done = subprocess.run(
        argv,
        cwd=ROOT,
        env=one_silo_cluster.env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 1, done.stderr[-2000:]
    assert done.stderr.splitlines()[-1] == (
        "error: ray.silo_cpus: got 2, so silo cleveland reserves 2 CPUs, more than any live node "
        "labelled silo=cleveland has (CPUs: 1); expected at most 1, or 0 to let silos share cores"
    )
    assert time.monotonic() - began < 45


@pytest.mark.slow
def test_two_silos_pinned_to_one_node_too_small_for_both_is_one_line_at_once(
    one_silo_cluster, tmp_path
):
    """Two silos given one node_label each fit the 1-CPU node alone: checked one worker at a
    time, the run was let go, and the second silo waited round.call_timeout_s for a CPU."""
    argv = [sys.executable, "-m", "silo_pfl", "run", JOB, "rounds=1", "tracking.enabled=false"]
    argv += [f"output_dir={tmp_path / 'runs'}", f"ray.address={one_silo_cluster.info['address']}"]
    argv += ["silos.cleveland.node_label={silo: cleveland}", "data.late_silos=[switzerland,va]"]
    argv += ["silos.hungarian.node_label={silo: cleveland}", "round.call_timeout_s=60"]
    argv += ["ray.silo_cpus=1", "ray.silos_per_worker=1"]
    began = time.monotonic()
    done = subprocess.run(
        argv, cwd=ROOT, env=one_silo_cluster.env, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 1, done.stderr[-2000:]
    assert done.stderr.splitlines()[-1] == (
        "error: ray.silo_cpus: got 1, so the 2 workers of silos cleveland, hungarian together "
        "reserve 2 CPUs, more than the live nodes labelled silo=cleveland have in all (CPUs: 1); "
        "expected at most 0.5, or 0 to let silos share cores"
    )
    assert time.monotonic() - began < 45


def _info(cluster: SimpleNamespace) -> dict[str, Any]:
    return json.loads(cluster.info_file.read_text())


@pytest.mark.slow
def test_a_silo_node_that_died_starts_again_on_sigusr1(one_silo_cluster):
    """The node is killed, raylet and all, as a machine that crashes; SIGUSR1 to local_cluster.py
    starts it again, labelled as before, and the info file names its new node id. (The fixture's
    end then stops the cluster with a hangup and checks that nothing of it is left.)"""
    local_cluster = cluster_script("local_cluster")
    marker, old = one_silo_cluster.info["marker"], _info(one_silo_cluster)["nodes"]["cleveland"]
    for pid in local_cluster._processes_marked(marker, "n1"):
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while local_cluster._processes_marked(marker, "n1"):
        assert time.monotonic() < deadline, "the killed node's processes did not go"
        time.sleep(0.1)
    one_silo_cluster.proc.send_signal(signal.SIGUSR1)
    time.sleep(0.3)  # the node is starting: a second signal then is done after it, not dropped
    one_silo_cluster.proc.send_signal(signal.SIGUSR1)
    deadline = time.monotonic() + 150
    while _info(one_silo_cluster)["nodes"]["cleveland"] == old:
        assert one_silo_cluster.proc.poll() is None, "local_cluster.py ended"
        assert time.monotonic() < deadline, "the node was not started again"
        time.sleep(0.2)
    new = _info(one_silo_cluster)
    assert new["nodes"]["cleveland"] not in (old, new["head"])
    assert {k: v for k, v in new.items() if k != "nodes"} == {
        k: v for k, v in one_silo_cluster.info.items() if k != "nodes"
    }
    raylets = [
        pid
        for pid in local_cluster._processes_marked(marker, "n1")
        if local_cluster._named(pid, local_cluster.RAYLET_NAME)
    ]
    assert len(raylets) == 1
    errors = one_silo_cluster.base / "cluster.err"
    deadline = time.monotonic() + 60
    while "nodes started again: none: every node is alive\n" not in errors.read_text():
        assert time.monotonic() < deadline, "the second SIGUSR1 was dropped"
        time.sleep(0.2)
    text = errors.read_text()
    assert text.index("nodes started again: cleveland\n") < text.index("none: every node")
