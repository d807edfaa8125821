"""`cluster/local_cluster.py` starts its nodes on ports no outgoing connection can take, and a
node whose `ray start` failed is stopped, alone, and started again."""

from __future__ import annotations

import os
import secrets
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from loopback_cluster import CLIENT_VARS, cluster_script


def test_free_ports_lie_below_the_ephemeral_range_are_distinct_and_skip_those_excluded():
    local_cluster = cluster_script("local_cluster")
    low = int(Path(local_cluster.EPHEMERAL_RANGE).read_text().split()[0])
    first = local_cluster.free_ports(8)
    second = local_cluster.free_ports(8, exclude=first)
    assert len(set(first + second)) == 16
    assert all(local_cluster.PORT_FLOOR <= port < low for port in first + second)
    with socket.socket() as sock:
        sock.bind((local_cluster.HOST, second[0]))


def _sleeper(env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(["sleep", "600"], env={**os.environ, **env}, start_new_session=True)


def test_a_node_is_stopped_alone():
    local_cluster = cluster_script("local_cluster")
    marker = secrets.token_hex(8)
    mark = {local_cluster.MARKER_VAR: marker}
    failed = _sleeper({**mark, local_cluster.NODE_VAR: "n1"})
    other = _sleeper({**mark, local_cluster.NODE_VAR: "n2"})
    try:
        deadline = time.monotonic() + 30
        while len(local_cluster._processes_marked(marker)) < 2:
            assert time.monotonic() < deadline, "the two processes did not start"
            time.sleep(0.05)
        assert local_cluster._processes_marked(marker, "n1") == [failed.pid]
        assert local_cluster.stop_marked(marker, grace=5, node="n1") == []
        assert failed.wait(timeout=5) is not None
        assert other.poll() is None
        assert local_cluster._processes_marked(marker) == [other.pid]
    finally:
        for proc in (failed, other):
            proc.kill()
            proc.wait()


def test_a_node_whose_start_failed_is_started_again(monkeypatch, capsys):
    """Its first temp dir is a file, so its first `ray start` fails, as a real one does."""
    local_cluster = cluster_script("local_cluster")
    for name in CLIENT_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RAY_AUTH_TOKEN", secrets.token_hex(32))  # ~/.ray/auth_token is left alone
    args = local_cluster._parser().parse_args(["cleveland"])
    cluster = local_cluster.LocalCluster(args)
    (cluster.temp_dir / "n1.1").write_text("not a directory")
    try:
        info = cluster.start()
        assert set(info["nodes"]) == {"cleveland"}
        assert info["nodes"]["cleveland"] != info["head"]
        assert "warning: node n1: " in capsys.readouterr().err
        assert (cluster.temp_dir / "n1.2").is_dir()
    finally:
        assert cluster.stop() == []


def test_a_taken_dashboard_or_tracking_port_is_refused_before_any_node_starts(tmp_path):
    """Ray starts a head whose dashboard port is taken without a dashboard; the cluster would then
    print that port as its Jobs API, where another cluster's answers."""
    local_cluster = cluster_script("local_cluster")
    script = Path(local_cluster.__file__)
    with socket.socket() as taken:
        taken.bind((local_cluster.HOST, 0))
        taken.listen()
        port = taken.getsockname()[1]
        for option in ("--dashboard-port", "--tracking-port"):
            done = subprocess.run(
                [sys.executable, str(script), "a", option, str(port), "--tracking-server"],
                capture_output=True,
                text=True,
                timeout=60,
                env={**os.environ, "TMPDIR": str(tmp_path)},
            )
            assert done.returncode == 2, done.stderr
            assert done.stderr == (
                f"error: {option} {port}: in use on {local_cluster.HOST}; give a free port, or "
                f"leave {option} out for one\n"
            )
            assert done.stdout == "" and not list(tmp_path.iterdir())


def test_bad_silo_names_a_tls_dir_without_certificates_or_a_missing_token_leave_nothing(
    tmp_path,
):
    """A silo name Ray cannot take as a label value, or one given twice, is one line before the
    head starts; a --tls-dir without certificates, or a token file that is not there, makes no
    temporary directory first."""
    local_cluster = cluster_script("local_cluster")
    script = Path(local_cluster.__file__)
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_TOKEN"} | {"TMPDIR": str(tmp_path)}
    missing = tmp_path / "no" / "token"
    before = set(Path("/tmp").glob("rc*"))
    for argv, more, code, line in (
        (["bad name"], {}, 2, "error: SILOS: got silo name 'bad name', expected 1 to 63 letters"),
        (["a", "b", "a"], {}, 2, "error: SILOS: a given twice; one node per silo"),
        (
            ["a", "--tls-dir", str(tmp_path / "none")],
            {},
            1,
            f"error: --tls-dir {tmp_path / 'none'}",
        ),
        (["a"], {"RAY_AUTH_TOKEN_PATH": str(missing)}, 2, f"error: RAY_AUTH_TOKEN_PATH={missing}"),
    ):
        command = [sys.executable, str(script), *argv]
        done = subprocess.run(command, capture_output=True, text=True, timeout=60, env=env | more)
        assert done.returncode == code, done.stderr
        assert done.stderr.startswith(line) and done.stderr.count("\n") == 1, done.stderr
        assert done.stdout == "" and not list(tmp_path.iterdir())
    assert set(Path("/tmp").glob("rc*")) <= before


@pytest.fixture
def no_token(tmp_path, monkeypatch) -> Path:
    """A home without ~/.ray/auth_token, and no token in the environment: the token's path."""
    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path / ".ray" / "auth_token"


def test_the_cluster_token_is_made_private(no_token, monkeypatch):
    """~/.ray/auth_token has mode 0600 from its creation: no chmod after it was written."""
    local_cluster = cluster_script("local_cluster")
    monkeypatch.setattr(Path, "chmod", lambda *_args, **_kwargs: None)  # only its mode at birth
    umask = os.umask(0o022)
    try:
        token = local_cluster.cluster_token()
    finally:
        os.umask(umask)
    assert len(token) == 64 and no_token.read_text() == token
    assert stat.S_IMODE(no_token.stat().st_mode) == 0o600
    assert sorted(p.name for p in no_token.parent.iterdir()) == ["auth_token"]


def test_a_cluster_token_made_meanwhile_is_used_not_replaced(no_token, monkeypatch):
    local_cluster = cluster_script("local_cluster")

    def made_meanwhile() -> None:
        """No token yet, as the cluster looks; another process makes it right after."""
        no_token.parent.mkdir()
        no_token.write_text("theirs")

    monkeypatch.setattr(local_cluster, "auth_token", made_meanwhile)
    assert local_cluster.cluster_token() == "theirs"
    assert no_token.read_text() == "theirs"
