"""The four-hospital job on a 5-node local cluster against one local node, in the same session.

    python benchmarks/multi_node.py [--pairs 2]

Starts `cluster/local_cluster.py cleveland hungarian switzerland va` (a head and a node per
hospital, `ray start`, token auth), then runs `silo-pfl run jobs/heart_disease.yaml` joined to
it (ray.placement=per_node) and on a fresh single-node local Ray (ray.placement=any),
alternately. Prints each run's accuracies, the largest per-silo difference between the two
placements (the same seed must give the same numbers), the federation's own wall time
(`wall_seconds`: set-up, rounds, export) and the command's end-to-end time, and their ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from paths import ROOT

SILOS = ("cleveland", "hungarian", "switzerland", "va")


def start_cluster(env: dict[str, str], tmp: Path) -> tuple[subprocess.Popen, dict]:
    info_file = tmp / "cluster.json"
    proc = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "cluster" / "local_cluster.py"),
            *SILOS,
            "--info-file",
            str(info_file),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )
    while not (info_file.exists() and info_file.read_text().strip()):
        if proc.poll() is not None:
            sys.exit("local_cluster.py failed")
        time.sleep(0.5)
    return proc, json.loads(info_file.read_text())


def run(env: dict[str, str], tmp: Path, *overrides: str) -> tuple[float, dict]:
    """End-to-end seconds of `silo-pfl run` on the job, and its results."""
    results = tmp / f"results-{secrets.token_hex(4)}.json"
    command = [sys.executable, "-m", "silo_pfl", "run", "jobs/heart_disease.yaml", "--quiet"]
    command += ["tracking.enabled=false", f"output_dir={tmp / 'runs'}", *overrides]
    began = time.perf_counter()
    subprocess.run([*command, "--results", str(results)], cwd=ROOT, env=env, check=True)
    return time.perf_counter() - began, json.loads(results.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=2)
    args = parser.parse_args()
    base = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env = {**base, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        cluster, info = start_cluster(env, tmp)
        rows = []
        try:
            for _ in range(args.pairs):
                multi = run({**env, "RAY_ADDRESS": info["address"]}, tmp, "ray.placement=per_node")
                single = run(env, tmp, "ray.placement=any", "ray.num_cpus=2")
                rows.append((multi, single))
        finally:
            cluster.send_signal(signal.SIGTERM)
            cluster.wait(timeout=120)
    for (m_cmd, m), (s_cmd, s) in rows:
        nodes = {silo["node_id"] for silo in m["silos"].values()}
        diff = max(
            abs(m["silos"][k]["test_accuracy"] - s["silos"][k]["test_accuracy"]) for k in SILOS
        )
        print(
            f"5 nodes: mean test acc {m['mean_test_accuracy']:.6f} ({len(nodes)} silo nodes), "
            f"wall {m['wall_seconds']:.1f} s, command {m_cmd:.1f} s | 1 node: "
            f"{s['mean_test_accuracy']:.6f}, wall {s['wall_seconds']:.1f} s, command "
            f"{s_cmd:.1f} s | largest per-silo difference {diff:.1e}"
        )
    wall = statistics.median(m["wall_seconds"] / s["wall_seconds"] for (_, m), (_, s) in rows)
    command = statistics.median(m / s for (m, _), (s, _) in rows)
    print(f"median ratio 5 nodes / 1 node: federation wall {wall:.2f}x, command {command:.2f}x")


if __name__ == "__main__":
    main()
