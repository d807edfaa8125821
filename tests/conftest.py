"""Shared fixtures: one local Ray instance per test session, the loopback cluster, and per-test
output directories; and the order that keeps the cluster's life short."""

from __future__ import annotations

import logging
import os

import pytest

os.environ.setdefault("RAY_DEDUP_LOGS", "0")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests on the shared loopback cluster run last, one after another, each file's in its
    own order: the cluster starts for the first of them and stops as the session ends. Idle, its
    five nodes and MLflow server take a quarter of a core (`benchmarks/idle_cluster.py`), which
    every test run beside them paid while they waited between test_cluster.py and
    test_ray_jobs.py and after it."""
    items.sort(key=lambda item: "loopback_cluster" in getattr(item, "fixturenames", ()))


@pytest.fixture(scope="session")
def ray_local():
    """A real local Ray, started once and shared by every test that runs a federation."""
    import ray

    if not ray.is_initialized():
        ray.init(
            address="local",
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            logging_level=logging.WARNING,
            # As cluster/local_cluster.py starts a cluster: every process, and every driver that
            # joins it, sends its metrics each second (Ray's default is 10 s), so a run that
            # joins waits 1 s, not 10, at its end for its last figures to be sent.
            _system_config={"metrics_report_interval_ms": 1000},
        )
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
