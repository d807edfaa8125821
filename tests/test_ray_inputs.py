"""Ray settings that cannot work fail at once, in one line naming the key, and leave no run
behind: a cluster address nothing listens on, and more CPUs reserved than a local Ray has."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from silo_pfl.cli import main

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
