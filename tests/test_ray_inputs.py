"""Ray settings that cannot work fail at once, in one line naming the key, and leave no run
behind: a cluster address nothing listens on, or something other than a Ray GCS answers on (an
HTTP server), an http:// address, more CPUs reserved than a local Ray has, and a $RAY_TMPDIR
too long for Ray's sockets."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest

from silo_pfl.cli import main
from silo_pfl.errors import FederationError
from silo_pfl.runtime import session

ROOT = Path(__file__).resolve().parents[1]
JOB = str(ROOT / "jobs" / "heart_disease.yaml")


def test_an_address_nothing_listens_on_is_one_line_not_a_hang(tmp_path):
    """In a fresh process, as a user runs it (a test process may hold a Ray already)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    argv = [sys.executable, "-m", "silo_pfl", "run", JOB, "rounds=1", "tracking.enabled=false"]
    argv += [f"output_dir={tmp_path / 'runs'}", "ray.address=127.0.0.1:1"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    assert done.stderr == (
        "error: ray.address: nothing accepts a connection at 127.0.0.1:1 (Connection refused); "
        "expected a running cluster's head, host:port (e.g. 10.0.0.1:6379)\n"
    )
    assert not (tmp_path / "runs").exists()


def test_a_ray_tmpdir_too_long_for_rays_sockets_is_one_line_naming_it(tmp_path):
    """Ray's sockets live under $RAY_TMPDIR/ray/session_*/sockets/, and an AF_UNIX path holds at
    most 107 bytes: Ray refuses with an OSError, which the run names in one line."""
    long = tmp_path / ("t" * max(1, 100 - len(str(tmp_path))))
    long.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_TMPDIR"] = str(long)
    argv = [sys.executable, "-m", "silo_pfl", "run", JOB, "rounds=1", "tracking.enabled=false"]
    argv += [f"output_dir={tmp_path / 'runs'}"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: RAY_TMPDIR: Ray's sockets under {long}")
    most = re.search(
        r"set RAY_TMPDIR to a directory path at most (\d+) bytes long, e\.g\. /tmp/ray$", lines[0]
    )
    assert most and 20 < int(most[1]) < len(str(long)), lines[0]  # the pid's digits vary
    assert not (tmp_path / "runs").exists()


def test_more_cpus_reserved_than_a_local_ray_has_names_ray_silo_cpus(ray_local, tmp_path, capsys):
    cpus = ray_local.cluster_resources()["CPU"]
    argv = ["run", JOB, "rounds=1", "tracking.enabled=false", f"output_dir={tmp_path / 'runs'}"]
    code = main([*argv, f"ray.silo_cpus={cpus}"])
    assert code == 1
    assert capsys.readouterr().err == (
        f"error: ray.silo_cpus: got {cpus:g}, which reserves {4 * cpus:g} CPUs for 4 silos, but "
        f"the local Ray has {cpus:g}; expected at most {cpus / 4:g}, or 0 to let silos share "
        "cores\n"
    )
    assert list((tmp_path / "runs").glob("*/*")) == []
    assert main([*argv, f"ray.silo_cpus={cpus / 4}", "--quiet"]) == 0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def _http_server() -> Iterator[int]:
    """A real HTTP server (`python -m http.server`) on a free loopback port, for the test's
    length; stopped by its process group."""
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "no http.server"
                time.sleep(0.1)
        yield port
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _run(tmp_path: Path, address: str) -> tuple[subprocess.CompletedProcess, float]:
    """The CLI joining `address`, in a fresh process as a user runs it; and its seconds."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    argv = [sys.executable, "-m", "silo_pfl", "run", JOB, "rounds=1", "tracking.enabled=false"]
    argv += [f"output_dir={tmp_path / 'runs'}", f"ray.address={address}"]
    began = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=90, env=env, cwd=tmp_path)
    return done, time.monotonic() - began


def _refused_beside_http(tmp_path: Path, scheme: str = "") -> tuple[str, int, float]:
    """The CLI joining `<scheme>127.0.0.1:<an HTTP server's port>`: refused with exit 1 and no
    run directory left; its stderr, the port and its seconds."""
    with _http_server() as port:
        done, seconds = _run(tmp_path, f"{scheme}127.0.0.1:{port}")
    assert done.returncode == 1, done.stderr
    assert not (tmp_path / "runs").exists()
    return done.stderr, port, seconds


def test_an_address_that_answers_but_is_no_gcs_is_one_line_within_seconds(ray_local, tmp_path):
    """An HTTP server (as a dashboard's port is) and a silent listener are refused at once; a
    real Ray GCS passes the same probe."""
    session.check_reachable(ray_local._private.worker._global_node.gcs_address)
    stderr, port, seconds = _refused_beside_http(tmp_path)
    assert stderr == (
        f"error: ray.address: 127.0.0.1:{port} answers, but not as a Ray cluster's GCS (it "
        "answers in plain text, as HTTP/1 does: '<!DOCTYPE HTML>'); give the head's GCS address "
        'host:port (ray start --head --port), or "auto"\n'
    )
    assert seconds < 30
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        began = time.monotonic()
        with pytest.raises(FederationError) as info:
            session.check_reachable(address, "RAY_ADDRESS")
    assert time.monotonic() - began < session.GCS_ANSWER_SECONDS + 2
    assert str(info.value) == (
        f"RAY_ADDRESS: {address} answers, but not as a Ray cluster's GCS (no answer to HTTP/2 "
        f"within {session.GCS_ANSWER_SECONDS:g} s); give the head's GCS address host:port "
        '(ray start --head --port), or "auto"'
    )


def test_an_http_address_is_one_whole_line(tmp_path):
    stderr, port, _ = _refused_beside_http(tmp_path, "http://")
    assert stderr == (
        f"error: ray.address: got http://127.0.0.1:{port}, an HTTP address (a dashboard's, for "
        'Ray Jobs); a run joins the GCS: host:port (ray start --head --port), or "auto"\n'
    )


def test_a_token_the_cluster_refuses_is_named_at_once(ray_local, tmp_path):
    """RAY_AUTH_MODE=token with a token that is not the cluster's: one line naming the token's
    source, at once, not Ray's 20 s of retries ending in 'Failed to connect'."""
    address = ray_local._private.worker._global_node.gcs_address
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH")}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="deadbeef")
    argv = [sys.executable, "-m", "silo_pfl", "run", JOB, "rounds=1", "tracking.enabled=false"]
    argv += [f"output_dir={tmp_path / 'runs'}", f"ray.address={address}"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    assert done.stderr == (
        f"error: ray.address: the cluster at {address} refused the token (RAY_AUTH_TOKEN); give "
        "the cluster's own token in RAY_AUTH_TOKEN or ~/.ray/auth_token\n"
    )
    assert not (tmp_path / "runs").exists()


def test_a_cluster_joined_without_ray_auth_mode_says_it_needs_it_at_once(ray_local, tmp_path):
    """Without RAY_AUTH_MODE=token Ray sends no token, and retries for 20 s before a generic
    'Failed to connect'; the probe names the missing setting at once, in one line."""
    address = ray_local._private.worker._global_node.gcs_address
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    argv = [sys.executable, "-m", "silo_pfl", "run", JOB, "rounds=1", "tracking.enabled=false"]
    argv += [f"output_dir={tmp_path / 'runs'}", f"ray.address={address}"]
    began = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert done.returncode == 1 and time.monotonic() - began < 15, done.stderr
    assert done.stderr == (
        f"error: ray.address: the cluster at {address} uses token authentication; set "
        "RAY_AUTH_MODE=token, with its token in RAY_AUTH_TOKEN or ~/.ray/auth_token\n"
    )
    assert not (tmp_path / "runs").exists()


def test_a_connection_error_from_ray_init_is_one_line(monkeypatch):
    """ConnectionError is an OSError: it must not fall through the socket-path check and leave
    the run with a bare 'ConnectionError: ...'. (ray.init is made to fail as it does when the
    cluster goes away between the probes and the join.)"""
    from silo_pfl.config import RayConfig

    def refuse(**_: object) -> None:
        raise ConnectionError("Failed to connect to Ray cluster")

    monkeypatch.setattr(session.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(session.ray, "init", refuse)
    with pytest.raises(FederationError) as info, session.ray_session(RayConfig()):
        pass
    assert str(info.value) == (
        "ray.address: cannot start or reach Ray at a local instance: Failed to connect to Ray "
        "cluster"
    )


def _auto(
    tmp_path: Path, current: str | None, prefix: Sequence[str] = ()
) -> tuple[subprocess.CompletedProcess, float]:
    """The CLI with ray.address=auto (run under `prefix`, if any), where the last `ray start`
    (its RAY_TMPDIR's ray/ray_current_cluster, which `ray start` writes) named `current`, or none
    did; and its seconds."""
    temp = tmp_path / "t"
    (temp / "ray").mkdir(parents=True)
    if current is not None:
        (temp / "ray" / "ray_current_cluster").write_text(current + "\n")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_TMPDIR=str(temp), RAY_AUTH_MODE="token")
    argv = [sys.executable, "-m", "silo_pfl", "run", JOB, "rounds=1", "tracking.enabled=false"]
    argv += [f"output_dir={tmp_path / 'runs'}", "ray.address=auto", "--quiet"]
    began = time.monotonic()
    done = subprocess.run(
        [*prefix, *argv], capture_output=True, text=True, timeout=90, env=env, cwd=tmp_path
    )
    return done, time.monotonic() - began


def test_auto_joins_the_cluster_the_last_ray_start_named_and_says_which(ray_local, tmp_path):
    address = ray_local._private.worker._global_node.gcs_address
    done, _ = _auto(tmp_path, address)
    assert done.returncode == 0, done.stderr[-2000:]
    said = f'ray.address "auto": joining {address}, the cluster the last `ray start` here started'
    assert said in done.stderr.splitlines(), done.stderr


def _pid_namespace() -> list[str] | None:
    """`unshare` into a fresh PID namespace, where no Ray of this machine's is seen; None where
    the kernel or container refuses it."""
    argv = ["unshare", "--pid", "--fork", "--mount-proc"]
    try:
        done = subprocess.run([*argv, "true"], capture_output=True, timeout=30)
    except FileNotFoundError:
        return None
    return argv if done.returncode == 0 else None


def test_auto_with_no_cluster_running_is_one_line_at_once(tmp_path):
    """No `ray start` of the user's named a cluster and no Ray GCS runs (a PID namespace hides the
    machine's): "auto" is refused in one line naming the key, and no run is left behind."""
    namespace = _pid_namespace()
    if namespace is None:
        pytest.skip("unshare cannot make a PID namespace here (needs root or user namespaces)")
    done, _ = _auto(tmp_path, None, namespace)
    assert done.returncode == 1, done.stderr
    assert done.stderr == (
        'error: ray.address: "auto" found no running Ray cluster on this machine; give the '
        "head's GCS address, host:port (ray start --head --port)\n"
    )
    assert not (tmp_path / "runs").exists()


def test_auto_whose_cluster_is_gone_is_one_line_at_once(tmp_path):
    """ "auto" gets the checks an explicit address gets: a cluster since stopped is named at once,
    not after Ray's minutes of retries (nor is another cluster on the machine joined instead)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        gone = f"127.0.0.1:{probe.getsockname()[1]}"
    done, seconds = _auto(tmp_path, gone)
    assert done.returncode == 1, done.stderr
    assert done.stderr.splitlines()[-1].startswith(
        f"error: ray.address: nothing accepts a connection at {gone} ("
    ), done.stderr
    assert seconds < 30 and not (tmp_path / "runs").exists()
