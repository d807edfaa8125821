"""A run in a process whose Ray the user initialised before it (a notebook's `ray.init`) uses
that Ray; where the config asks for another (`ray.address`) or for CPUs (`ray.num_cpus`), a
warning says so, rather than nothing. A run on a Ray its own command started warns of neither."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

from silo_pfl.cli import main
from silo_pfl.config import RayConfig
from silo_pfl.runtime.session import check_connected

ROOT = Path(__file__).resolve().parents[1]
JOB = "jobs/heart_disease.yaml"
SESSION = "silo_pfl.runtime.session"


def test_an_address_other_than_the_connected_rays_is_named_in_a_warning(
    ray_local, tmp_path, caplog
):
    runs = tmp_path / "runs"
    argv = ["run", JOB, "rounds=1", "tracking.enabled=false", f"output_dir={runs}"]
    with caplog.at_level(logging.WARNING, logger=SESSION):
        assert main([*argv, "ray.address=10.255.255.1:6379", "--quiet"]) == 0
    connected = ray_local.get_runtime_context().gcs_address
    assert [r.getMessage() for r in caplog.records if r.name == SESSION] == [
        "ray.address=10.255.255.1:6379 has no effect: this process is connected to Ray at "
        f"{connected} already (ray.init was called before the run), and the run uses it; call "
        "ray.shutdown() first to join 10.255.255.1:6379"
    ]
    assert list(runs.glob("*/*/result.json"))


def test_the_connected_rays_own_address_under_any_name_of_this_machine_is_no_warning(
    ray_local, caplog
):
    port = ray_local.get_runtime_context().gcs_address.rsplit(":", 1)[1]
    with caplog.at_level(logging.WARNING, logger=SESSION):
        for host in ("127.0.0.1", "localhost", os.uname().nodename):
            check_connected(RayConfig(address=f"{host}:{port}"))
        for address in ("auto", "ray://127.0.0.1:10001"):
            check_connected(RayConfig(address=address))
        assert caplog.records == []
        check_connected(RayConfig(address="127.0.0.1:1"))
        check_connected(RayConfig(address="local"))  # a fresh local Ray: not this one
        check_connected(RayConfig(num_cpus=8))
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 3 and warned[0].startswith("ray.address=127.0.0.1:1 has no effect")
    assert warned[1].startswith("ray.address=local has no effect")
    assert warned[2].startswith("ray.num_cpus=8 has no effect: this process is connected to Ray")


def test_a_cli_run_on_the_ray_it_started_warns_of_nothing(tmp_path):
    """The command's own session starts Ray with ray.num_cpus, and the run inside it finds Ray
    connected: that is no Ray of the user's."""
    argv = [sys.executable, "-m", "silo_pfl", "run", JOB, "rounds=1", "tracking.enabled=false"]
    argv += [f"output_dir={tmp_path / 'runs'}", "ray.num_cpus=2", "--quiet"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "has no effect" not in done.stderr, done.stderr


def test_compare_runs_a_job_that_names_a_ray_on_its_workers_own_without_a_word(
    ray_local, tmp_path, caplog
):
    """compare runs every job on its worker's local Ray: a job's ray.address and ray.num_cpus are
    set aside for every run. Before, the parent's check of each run's config and the worker's run
    each warned, of a cluster the run never joins."""
    from silo_pfl.compare import parse_spec
    from silo_pfl.compare_runs import execute, make_run

    job = tmp_path / "job.yaml"
    job.write_text((ROOT / JOB).read_text() + "ray:\n  address: 10.255.255.1:6379\n  num_cpus: 8\n")
    jobs = {"heart": {"config": str(job), "seeds": [0], "overrides": ["rounds=1"]}}
    spec = parse_spec({"baseline": None, "jobs": jobs, "algorithms": {"local": {}}}, "spec.yaml")
    with caplog.at_level(logging.WARNING):
        run = make_run(spec.jobs["heart"], spec.rows["local"], (), 0)
        result = execute(run.config, list(run.overrides))
    assert "error" not in result, result
    assert caplog.records == []


def test_an_address_whose_name_cannot_be_encoded_is_a_warning_not_a_crash(ray_local, caplog):
    with caplog.at_level(logging.WARNING, logger=SESSION):
        check_connected(RayConfig(address="head..cluster:6379"))
    assert caplog.records[0].getMessage().startswith("ray.address=head..cluster:6379 has no")


TWO_THREADS = """
import sys, threading
from silo_pfl.callbacks import Callback
from silo_pfl.errors import FederationError
from silo_pfl.federation import Federation
from silo_pfl.settings import load_config

started, tried = threading.Event(), threading.Event()


class Hold(Callback):
    def on_round_end(self, summary):
        started.set()
        tried.wait(120)


def config(name):
    return load_config(
        "jobs/heart_disease.yaml",
        [f"name={name}", "rounds=2", "tracking.enabled=false", f"output_dir={sys.argv[1]}"],
    )


def first():
    result = Federation(config("first"), callbacks=[Hold()]).run()
    print("first", len(result.history))


thread = threading.Thread(target=first)
thread.start()
started.wait(300)
try:
    Federation(config("second")).run()
    print("second ran")
except FederationError as error:
    print("second:", error)
tried.set()
thread.join()
"""


def test_a_second_thread_is_refused_the_ray_another_threads_run_started(tmp_path):
    """Two runs on threads, without the user's ray.init: the first starts Ray and would stop it
    at its end, under the second, so the second is refused in one line; the first completes."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run(
        [sys.executable, "-c", TWO_THREADS, str(tmp_path / "runs")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == [
        "second: another federation runs in this process, on a Ray its run started and will "
        "stop; to run several at once, call ray.init() before them (they then share it), or run "
        "them one after another",
        "first 2",
    ], done.stdout
    assert not (tmp_path / "runs" / "second").exists() or not any(
        (tmp_path / "runs" / "second").iterdir()
    )
