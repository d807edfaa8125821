"""Waiting on actors: bounded, and whoever did not answer is named."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from silo_pfl.errors import FederationError
from silo_pfl.runtime.actors import get


def test_a_wait_past_its_bound_names_the_silos_that_did_not_answer(ray_local):
    @ray_local.remote(num_cpus=0)
    def answer(seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    refs = [answer.remote(0), answer.remote(30), answer.remote(0)]
    assert get(refs[:1], "silo set-up", 60, ["silo a"]) == [0]
    began = time.monotonic()
    with pytest.raises(FederationError) as info:
        get(refs, "silo set-up", 2, ["silo a", "silo b", "silo c"])
    assert time.monotonic() - began < 10
    assert str(info.value) == "silo set-up: no answer within round.call_timeout_s=2 s from silo b"
    with pytest.raises(FederationError) as info:
        get(refs[1:2], "round 1: aggregation", 0.5, key="round.timeout_s")
    assert str(info.value) == "round 1: aggregation: no answer within round.timeout_s=0.5 s"
    ray_local.cancel(refs[1], force=True)


def test_round_timeout_must_be_positive(job):
    from silo_pfl.errors import ConfigError

    with pytest.raises(ConfigError, match="round.timeout_s: got 0.0, expected a number of seconds"):
        job("jobs/heart_disease.yaml", "round.timeout_s=0")


PLUGIN = """
from silo_pfl.algorithms import register
from silo_pfl.algorithms.fedavg import FedAvg


@register
class OnTheDriverOnly(FedAvg):
    name = "on_the_driver_only"
"""


def test_a_worker_that_cannot_open_its_silos_answers_why_not_that_it_restarted(
    ray_local, job, tmp_path, monkeypatch
):
    """A plugin the driver imports (from a directory on its own path) and the silos' workers
    cannot, as a node without a plugin the driver has: the run ends with the import's error,
    where it said that each silo's worker had restarted."""
    from silo_pfl.errors import ConfigError
    from silo_pfl.federation import Federation

    (tmp_path / "driver_only_plugin.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = job(
        "jobs/heart_disease.yaml",
        "plugins=[driver_only_plugin]",
        "algorithm.name=on_the_driver_only",
        "rounds=1",
        "tracking.enabled=false",
    )
    with pytest.raises(ConfigError, match=r"^plugins\[0\]: cannot import 'driver_only_plugin' \("):
        Federation(cfg).run()


CLI = """
import sys
sys.path.insert(0, sys.argv[1])
from silo_pfl.cli import main
sys.exit(main(sys.argv[2:]))
"""


def test_a_worker_that_cannot_open_its_silos_is_one_line_on_the_command_line(tmp_path):
    """The workers' failed `open`, which no one waits on, printed Ray's 'Unhandled error' and
    its traceback for each worker before the run's one line."""
    import subprocess
    import sys

    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "driver_only_plugin.py").write_text(PLUGIN)
    overrides = [
        "plugins=[driver_only_plugin]",
        "algorithm.name=on_the_driver_only",
        "rounds=1",
        "tracking.enabled=false",
        "metrics.enabled=false",
        f"output_dir={tmp_path / 'runs'}",
    ]
    done = subprocess.run(
        [sys.executable, "-c", CLI, str(plugins), "run", "jobs/heart_disease.yaml", *overrides],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=Path(__file__).resolve().parents[1],
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr[-3000:]
    assert len(lines) == 1, done.stderr[-3000:]
    assert lines[0].startswith("error: plugins[0]: cannot import 'driver_only_plugin' (")
