"""A run in a process whose Ray was initialised before it (a notebook's `ray.init`) uses that
Ray: a `ray.address` naming another is refused in one line, not trained past in silence."""

from __future__ import annotations

import logging

import pytest

from silo_pfl.cli import main
from silo_pfl.config import RayConfig
from silo_pfl.errors import FederationError
from silo_pfl.runtime.session import check_connected

JOB = "jobs/heart_disease.yaml"


def test_an_address_other_than_the_connected_rays_is_one_line_and_no_run(
    ray_local, tmp_path, capsys
):
    runs = tmp_path / "runs"
    argv = ["run", JOB, "rounds=1", "tracking.enabled=false", f"output_dir={runs}"]
    assert main([*argv, "ray.address=10.255.255.1:6379"]) == 1
    connected = ray_local.get_runtime_context().gcs_address
    assert capsys.readouterr().err.splitlines() == [
        "error: ray.address: got 10.255.255.1:6379, but this process is connected to Ray at "
        f"{connected} already (ray.init was called before the run); call ray.shutdown() first, "
        "or leave ray.address out to run on the Ray in use"
    ]
    assert not list(runs.glob("*/*/result.json"))


def test_the_connected_rays_own_address_is_taken_under_any_name_of_its_host(ray_local, caplog):
    host, port = ray_local.get_runtime_context().gcs_address.rsplit(":", 1)
    for name in (host, "localhost" if host == "127.0.0.1" else host):
        check_connected(RayConfig(address=f"{name}:{port}"))
    with pytest.raises(FederationError, match="^ray.address: got .*:1, but this process"):
        check_connected(RayConfig(address=f"{host}:1"))
    with caplog.at_level(logging.WARNING, logger="silo_pfl.runtime.session"):
        check_connected(RayConfig(num_cpus=8))
    assert "ray.num_cpus=8 has no effect: this process is connected to Ray at" in caplog.text
