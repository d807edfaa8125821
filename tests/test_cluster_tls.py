"""A real multi-node Ray cluster with TLS between its nodes, and a federation joined to it.

`cluster/make_certs.sh` makes the certificates, `cluster/local_cluster.py --tls-dir` starts a head
and one node per hospital with them (and with a token of this test's own), each hospital's node
holding its own data (`--data-root`). A driver with the TLS variables and the token runs
jobs/hospitals_on_nodes.yaml on it; one with the token alone cannot even join.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from loopback_cluster import cluster_script

ROOT = Path(__file__).resolve().parents[1]
SILOS = ("cleveland", "hungarian")
TLS_VARS = ("RAY_USE_TLS", "RAY_TLS_SERVER_CERT", "RAY_TLS_SERVER_KEY", "RAY_TLS_CA_CERT")
START_TIMEOUT = 180.0
PROBE_TIMEOUT = 30.0
PROBE_PATIENCE_S = 5

# Joins the cluster at argv[1] and prints how many nodes are alive: the probe of who can join.
_JOIN_SCRIPT = """
import sys
import ray
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
print("joined", sum(1 for n in ray.nodes() if n["Alive"]), flush=True)
"""


def _client_env(token: str, tls: dict[str, str]) -> dict[str, str]:
    """This environment without any Ray address or TLS setting, plus the token and `tls`."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS" and k not in TLS_VARS}
    return {**env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token, **tls}


def _probe_env(token: str, tls: dict[str, str]) -> dict[str, str]:
    """A join probe's environment: `_client_env`, with Ray's patience for an unreachable GCS
    cut from 60 s to PROBE_PATIENCE_S, so that a refused client gives up inside the probe's time
    rather than being killed at its end. Both probes get the same budget, so TLS is the only
    difference between them."""
    patience = {"RAY_gcs_rpc_server_reconnect_timeout_s": str(PROBE_PATIENCE_S)}
    return {**_client_env(token, tls), **patience}


def _markers_of(token: str) -> set[str]:
    """The markers of the live processes started with this test's token (the cluster's nodes).

    For teardown when the cluster never wrote its info: the token is unique to this test."""
    needle, markers = f"RAY_AUTH_TOKEN={token}".encode(), set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if needle in environ:
            for item in environ:
                if item.startswith(b"SILO_PFL_CLUSTER="):
                    markers.add(item.split(b"=", 1)[1].decode())
    return markers


def _start_join(address: str, env: dict[str, str]) -> subprocess.Popen:
    """Start the join probe in a session of its own."""
    return subprocess.Popen(
        [sys.executable, "-c", _JOIN_SCRIPT, address],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _end_join(probe: subprocess.Popen, started: float) -> tuple[int | None, str]:
    """Its exit code (None: still trying PROBE_TIMEOUT s after `started`, killed), its output."""
    try:
        out, _ = probe.communicate(timeout=max(0.0, started + PROBE_TIMEOUT - time.monotonic()))
        return probe.returncode, out
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(probe.pid, signal.SIGKILL)
        out, _ = probe.communicate()
        return None, out


@pytest.mark.slow
def test_a_federation_over_tls_and_no_client_without_it(tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    certs, nodes = tmp_path / "certs", tmp_path / "nodes"
    subprocess.run(
        ["bash", str(ROOT / "cluster" / "make_certs.sh"), str(certs), "127.0.0.1"],
        check=True,
        capture_output=True,
    )
    subprocess.run(
        [sys.executable, str(ROOT / "cluster" / "hospital_data.py"), str(nodes), *SILOS],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )

    local_cluster = cluster_script("local_cluster")
    token = secrets.token_hex(32)
    info_file = tmp_path / "cluster.json"
    log = (tmp_path / "cluster.log").open("w")
    proc = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "cluster" / "local_cluster.py"),
            *SILOS,
            "--tls-dir",
            str(certs),
            "--data-root",
            str(nodes),
            "--info-file",
            str(info_file),
        ],
        env=_client_env(token, {}),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    info, plain = None, None
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while not (info_file.exists() and info_file.read_text().strip()):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(
                    "cluster/local_cluster.py did not come up: "
                    + (tmp_path / "cluster.log").read_text()[-2000:]
                )
            time.sleep(0.5)
        info = json.loads(info_file.read_text())
        tls = {k: v for k, v in info["env"].items() if k in TLS_VARS}
        assert tls == {
            "RAY_USE_TLS": "1",
            "RAY_TLS_SERVER_CERT": str(certs / "node.crt"),
            "RAY_TLS_SERVER_KEY": str(certs / "node.key"),
            "RAY_TLS_CA_CERT": str(certs / "ca.crt"),
        }

        # A client with the token alone tries to join, meanwhile (it may take PROBE_TIMEOUT s).
        plain_started = time.monotonic()
        plain = _start_join(info["address"], _probe_env(token, {}))

        # The federation, joined with the token and the TLS variables: each silo on its node.
        results = tmp_path / "results.json"
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "silo_pfl",
                "run",
                "jobs/hospitals_on_nodes.yaml",
                f"ray.address={info['address']}",
                "rounds=2",
                "tracking.enabled=false",
                f"output_dir={tmp_path / 'runs'}",
                "--results",
                str(results),
            ],
            cwd=ROOT,
            env=_client_env(token, tls),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == 0, run.stderr[-3000:]
        silos = json.loads(results.read_text())["silos"]
        assert {name: silos[name]["node_id"] for name in SILOS} == info["nodes"]

        # A driver without the TLS variables, or with another CA's certificates, is told so in
        # one line within seconds; Ray would retry for minutes, or name the wrong cause.
        other = tmp_path / "other_ca"
        subprocess.run(
            ["bash", str(ROOT / "cluster" / "make_certs.sh"), str(other), "127.0.0.1"],
            check=True,
            capture_output=True,
        )
        foreign = {**tls, "RAY_TLS_CA_CERT": str(other / "ca.crt")}
        foreign |= {"RAY_TLS_SERVER_CERT": str(other / "node.crt")}
        foreign |= {"RAY_TLS_SERVER_KEY": str(other / "node.key")}
        address = info["address"]
        command = [sys.executable, "-m", "silo_pfl", "run", "jobs/hospitals_on_nodes.yaml"]
        command += [f"ray.address={address}", "rounds=1", "tracking.enabled=false"]
        for client, expected in (
            ({}, f"error: ray.address: {address} speaks TLS: the cluster's nodes run with "),
            (
                foreign,
                f"error: ray.address: {address}: its TLS certificate is not signed by "
                f"RAY_TLS_CA_CERT={other / 'ca.crt'} (",
            ),
        ):
            began = time.monotonic()
            refused = subprocess.run(
                command,
                cwd=ROOT,
                env=_client_env(token, client),
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert time.monotonic() - began < 60
            assert refused.returncode != 0
            assert refused.stderr.count("\n") == 1, refused.stderr[-2000:]
            assert refused.stderr.startswith(expected), refused.stderr

        # The same probe joins with the TLS variables, and cannot with the token alone.
        started = time.monotonic()
        code, out = _end_join(_start_join(info["address"], _probe_env(token, tls)), started)
        assert code == 0 and f"joined {1 + len(SILOS)}" in out, out[-2000:]
        code, out = _end_join(plain, plain_started)
        assert code != 0, f"a client without TLS joined the TLS cluster: {out[-2000:]}"
        assert "joined" not in out
    finally:
        if plain is not None and plain.poll() is None:
            os.killpg(plain.pid, signal.SIGKILL)
            plain.communicate()
        proc.send_signal(signal.SIGTERM)
        try:
            stopped = proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            stopped = None
            os.killpg(proc.pid, signal.SIGKILL)
        left = local_cluster._processes_marked(info["marker"]) if info else None
        # Whatever the cluster did not stop (killed, or before it wrote its info): stop it here.
        for marker in {info["marker"]} if info else _markers_of(token):
            local_cluster.stop_marked(marker)
        log.close()
    assert stopped == 0, (tmp_path / "cluster.log").read_text()[-2000:]
    assert left == []
