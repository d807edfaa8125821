"""Shared fixtures: one local Ray instance per test session, the loopback cluster, and per-test
output directories; and the order that keeps the cluster's life short."""

from __future__ import annotations

import os
import signal

import pytest
import session_ray

os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault(session_ray.NODE_ONLY_VAR, "premises")  # before any Ray starts


def _stop_on_sigterm(signum: int, frame: object) -> None:
    """SIGTERM (a CI's timeout, `kill`) ends the session as Ctrl-C does: pytest stops, and the
    fixtures' teardowns stop the clusters and servers they started. Python's default would end
    the process at once and leave them running."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one is enough: the teardowns must finish
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_sessionstart(session: pytest.Session) -> None:
    signal.signal(signal.SIGTERM, _stop_on_sigterm)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests on the shared loopback cluster run last, one after another, each file's in its
    own order: the cluster starts for the first of them and stops as the session ends, so it
    idles beside no other test (docs/BENCHMARKS.md, "The loopback cluster's tests last")."""
    items.sort(key=lambda item: "loopback_cluster" in getattr(item, "fixturenames", ()))


@pytest.fixture(scope="session")
def ray_local():
    """A real local Ray, started once and shared by every test that runs a federation."""
    import ray

    if not ray.is_initialized():
        session_ray.start()
    yield ray
    from silo_pfl.runtime.session import shutdown_local

    shutdown_local()


@pytest.fixture(scope="session")
def loopback_cluster(tmp_path_factory):
    """The real multi-node cluster of tests/loopback_cluster.py, started once per session."""
    from loopback_cluster import start

    yield from start(tmp_path_factory.mktemp("loopback_cluster"))


@pytest.fixture(autouse=True)
def mlflow_store(tmp_path, monkeypatch):
    """Every test's default MLflow store (tracking.uri unset) is a SQLite file under tmp_path."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return uri


@pytest.fixture
def job(tmp_path):
    """Build a validated config from a job YAML with overrides; outputs go under tmp_path."""
    from silo_pfl.settings import load_config

    def make(path: str, *overrides: str):
        return load_config(path, [f"output_dir={tmp_path / 'runs'}", *overrides])

    return make
