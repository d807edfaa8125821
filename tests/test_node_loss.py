"""A silo's node that dies, on the real loopback cluster: the rounds go on without the silo at
once (round.min_silos allowing), rather than each waiting round.call_timeout_s for Ray to
restart an actor that no live node may host; the run's end names the silo and the label. Once
the node is back, `--resume` finishes the run, the silo's model selected as its checkpoints
say."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from loopback_cluster import cluster_script

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
LABEL = "spare"  # the node va is pinned to, which this test starts and kills


def _start_spare_node(local_cluster, address: str, env: dict[str, str], marker: str) -> Path:
    """`ray start` one 1-CPU node labelled silo=spare into the cluster, its processes marked."""
    temp = Path(tempfile.mkdtemp(prefix="rs", dir="/tmp"))
    agent, metrics = local_cluster.free_ports(2)
    command = [str(local_cluster.BIN / "ray"), "start", f"--address={address}"]
    command += [f"--node-ip-address={local_cluster.HOST}", "--num-cpus=1"]
    command += [f"--labels={local_cluster.SILO_LABEL}={LABEL}", f"--temp-dir={temp}"]
    command += [f"--dashboard-agent-listen-port={agent}", f"--metrics-export-port={metrics}"]
    command += ["--disable-usage-stats"]
    node_env = {**env, local_cluster.MARKER_VAR: marker}
    done = subprocess.run(
        command, env=node_env, capture_output=True, text=True, timeout=120, start_new_session=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return temp


def test_a_silo_whose_node_died_is_left_out_at_once_named_at_the_end_and_resumed_once_back(
    loopback_cluster, tmp_path
):
    local_cluster = cluster_script("local_cluster")
    info, env = loopback_cluster.info, loopback_cluster.env
    marker = secrets.token_hex(8)
    temps = [_start_spare_node(local_cluster, info["address"], env, marker)]
    command = [sys.executable, "-m", "silo_pfl.cli", "run", "jobs/heart_disease.yaml"]
    command += [f"ray.address={info['address']}", "ray.placement=per_node"]
    command += [f"silos.va.node_label={{silo: {LABEL}}}", "round.min_silos=3", "rounds=6"]
    command += ["round.call_timeout_s=200", "tracking.enabled=false"]
    command += [f"output_dir={tmp_path / 'runs'}", f"--results={tmp_path / 'results.json'}"]
    proc = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("round 2/"):
                for pid in local_cluster._processes_marked(marker):
                    os.kill(pid, signal.SIGKILL)  # the node crashes: raylet, workers and all
                break
        rest, _ = proc.communicate(timeout=300)
        temps.append(_start_spare_node(local_cluster, info["address"], env, marker))
        resumed = subprocess.run(
            [*command, "--resume"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
        )
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        local_cluster.stop_marked(marker)
        for temp in temps:
            shutil.rmtree(temp, ignore_errors=True)
    printed = "".join(lines) + rest
    assert proc.returncode != 0, printed[-3000:]
    reason = f"no live Ray node carries its label silo={LABEL}"
    assert f"silo va cannot rejoin: {reason}" in printed
    assert f"silo va left out: {reason}" in printed
    for round_ in (4, 5, 6):
        assert f"round {round_}/6" in printed, f"round {round_} did not go on without va"
    last = printed.strip().splitlines()[-1]
    assert last.startswith(f"error: the final selection failed (va: {reason}); once such a node")
    assert "Traceback" not in printed
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert [r["round"] for r in results["history"]] == [1, 2, 3, 4, 5, 6]
    va = results["silos"]["va"]
    assert 1 <= va["selected_round"] <= va["rounds_taken_part"] < 6, va  # it missed rounds
    assert va["node_id"] not in (info["head"], *info["nodes"].values())
