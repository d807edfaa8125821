"""Ray's default token for a local instance: made once and whole, so that local starts racing on
a machine without one (two runs, `silo-pfl compare`'s workers) all use the same token."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from silo_pfl.runtime.ray_token import default_token_path, ensure_local_token

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A home without a token, and no token or mode in the environment."""
    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path


def test_starts_racing_on_a_home_without_a_token_all_make_the_same_one(home):
    threads, barrier = 8, threading.Barrier(8)

    def start(_: int) -> str:
        barrier.wait()
        ensure_local_token()
        return default_token_path().read_text()

    with ThreadPoolExecutor(threads) as pool:
        tokens = set(pool.map(start, range(threads)))
    (token,) = tokens
    assert len(token) == 64 and int(token, 16) >= 0
    assert sorted(p.name for p in (home / ".ray").iterdir()) == ["auth_token"]
    assert stat.S_IMODE(default_token_path().stat().st_mode) == 0o600


def test_an_existing_token_is_kept_and_none_is_made_where_ray_would_not_use_it(home, monkeypatch):
    path = default_token_path()
    path.parent.mkdir()
    path.write_text("operator-chosen")
    ensure_local_token()
    assert path.read_text() == "operator-chosen"
    path.unlink()
    for name, value in [("RAY_AUTH_MODE", "disabled"), ("RAY_AUTH_TOKEN", "t" * 64)]:
        with monkeypatch.context() as scoped:
            scoped.setenv(name, value)
            ensure_local_token()
        assert not path.exists(), name


@pytest.mark.slow
def test_a_local_run_on_a_home_without_a_token_makes_it_and_ray_accepts_it(home):
    code = (
        "import ray\n"
        "from silo_pfl.config import RayConfig\n"
        "from silo_pfl.runtime.session import ray_session\n"
        "with ray_session(RayConfig(num_cpus=1)):\n"
        "    print(ray.get(ray.remote(lambda: 'worker ran').remote()))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "worker ran"
    assert stat.S_IMODE(default_token_path().stat().st_mode) == 0o600  # ours, not Ray's 0644
