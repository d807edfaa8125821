"""`silo-pfl compare` when things go wrong: a worker process that dies (its pool broken), a gain
over a baseline that failed on some seeds, bad `published` text, interpolations that cannot be
resolved, and the commit recorded from another working directory."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from silo_pfl import compare as compare_module
from silo_pfl import compare_table
from silo_pfl.compare import compare, git_commit, load_spec, parse_spec
from silo_pfl.compare_runs import execute
from silo_pfl.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
HEART = str(ROOT / "jobs" / "heart_disease.yaml")
DYING = "train.lr=0.2"
BROKEN_TWICE = "its worker process died (BrokenProcessPool), twice"


def dies_on_one_candidate(config: str, overrides: Sequence[str]) -> dict[str, Any]:
    """A real run, except that the candidate DYING kills its worker (as an OOM kill would)."""
    if DYING in overrides:
        os._exit(9)
    return execute(config, overrides)


def test_a_worker_that_dies_fails_only_its_own_run(tmp_path, monkeypatch):
    """The pool it breaks fails every run it holds: each is run again, alone; only the one that
    breaks its pool a second time fails, and the tables are written."""
    monkeypatch.setattr(compare_module, "execute", dies_on_one_candidate)
    spec = parse_spec(
        {
            "jobs": {
                "heart": {
                    "config": HEART,
                    "seeds": [0],
                    "overrides": ["rounds=1", "train.local_epochs=1"],
                }
            },
            "algorithms": {"local": {}, "fedavg": {"candidates": [[DYING], ["train.lr=0.05"]]}},
        },
        str(tmp_path / "spec.yaml"),
    )
    lines: list[str] = []
    outcome = compare(spec, 2, tmp_path / "cache", log=lines.append)
    assert outcome.failed_runs == [f"heart fedavg [{DYING}] seed 0: {BROKEN_TWICE}"], lines
    assert outcome.computed == 3
    # Only the runs that had started run again; the one still queued goes back to the pool.
    (again,) = [line for line in lines if "running again" in line]
    assert DYING in again and "train.lr=0.05" not in again, again
    local, fedavg = outcome.units
    assert outcome.records[local.first[0].key].result is not None
    assert fedavg.chosen == 1 and outcome.records[fedavg.first[1].key].result is not None
    data = compare_table.report(outcome, "silo-pfl compare", "cache", "out.json")
    compare_table.write(data, str(tmp_path / "RESULTS.md"), str(tmp_path / "out.json"))
    assert "failed" in (tmp_path / "RESULTS.md").read_text()
    assert len(list((tmp_path / "cache").glob("*.json"))) == 2


def seed_result(score: float) -> dict[str, Any]:
    return {
        "key": "k",
        "command": "c",
        "cached": True,
        "mean_test_accuracy": score,
        "worst_test_accuracy": score,
        "std_test_accuracy": 0.0,
        "mean_val_accuracy": score,
        "test_accuracy": {"a": score, "b": score},
        "val_accuracy": {"a": score, "b": score},
        "bytes_sent_per_round": {"a": 10, "b": 10},
        "wall_seconds": 1.0,
    }


def table_row(scores: dict[int, float | None], base: dict[int, float]) -> dict[str, Any]:
    """A row of `compare_table.report` from its seeds' scores (None: the seed failed), with
    its gain over a baseline that has the seeds of `base`."""
    seeds = {str(s): seed_result(v) if v is not None else {"error": "E"} for s, v in scores.items()}
    ok = [v for v in seeds.values() if "error" not in v]
    figure = {"mean": sum(v["mean_test_accuracy"] for v in ok) / len(ok), "std_over_seeds": None}
    return {
        "algorithm": "x",
        "overrides": [],
        "candidates": [{"overrides": [], "error": None, "chosen": True}],
        "seeds": seeds,
        "failed_seeds": {s: "E" for s, v in seeds.items() if "error" in v},
        "mean_test_accuracy": figure,
        "worst_test_accuracy": figure,
        "std_test_accuracy": figure,
        "mean_val_accuracy": figure["mean"],
        "bytes_sent_per_round": 10.0,
        "wall_seconds": 1.0,
        "gain_over_baseline": compare_table.gains(
            {int(s): v["test_accuracy"] for s, v in seeds.items() if "error" not in v},
            {s: {"a": v, "b": v} for s, v in base.items()},
        ),
    }


def test_a_gain_over_fewer_seeds_than_the_row_has_names_its_seeds():
    rows = {
        "local": table_row({0: 0.7, 1: None}, {0: 0.7}),
        "fedavg": table_row({0: 0.6, 1: 0.9}, {0: 0.7}),
        "ditto": table_row({0: 0.8, 1: None}, {0: 0.7}),
    }
    job = {"config": HEART, "seeds": [0, 1], "overrides": [], "baseline": "local"}
    job.update(algorithms=rows, not_run={}, published=None)
    table = {line.split(" | ")[0][2:]: line for line in compare_table._job_table("heart", job)}
    assert "| -10.0 (seed 0 only) | -10.0 (a) |" in table["fedavg"]
    assert "| +10.0 | +10.0 (a) |" in table["ditto"]  # its mean already says seed 0 only


@pytest.mark.parametrize("key", ["source", "note"])
@pytest.mark.parametrize("value", [None, 2022, "  "])
def test_published_text_must_be_text(key, value):
    published = {"source": "a paper", "figures": {"local": 0.7}, key: value}
    raw = {"jobs": {"h": {"config": HEART, "published": published}}, "algorithms": {"local": {}}}
    with pytest.raises(ConfigError) as error:
        parse_spec(raw, "spec.yaml")
    assert str(error.value) == (
        f"spec.yaml: jobs.h.published.{key}: expected non-empty text, got {value!r}"
    )


def test_a_failing_table_writes_neither_output(tmp_path):
    (tmp_path / "out.json").write_text("old")
    data = {"command": "x"}  # markdown() fails on it
    with pytest.raises(KeyError):
        compare_table.write(data, str(tmp_path / "RESULTS.md"), str(tmp_path / "out.json"))
    assert (tmp_path / "out.json").read_text() == "old"


def test_an_unresolvable_interpolation_is_one_line_naming_the_spec(tmp_path, monkeypatch):
    monkeypatch.delenv("NOPE_X", raising=False)
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        f"jobs:\n  h:\n    config: {HEART}\nalgorithms:\n"
        '  local:\n    overrides: ["train.lr=${oc.env:NOPE_X}"]\n'
    )
    with pytest.raises(ConfigError) as error:
        load_spec(spec)
    message = str(error.value)
    assert message.startswith(f"{spec}: algorithms.local.overrides[0]: ")
    assert "NOPE_X" in message and "\n" not in message


def test_the_commit_is_silo_pfls_checkout_whatever_the_working_directory(tmp_path, monkeypatch):
    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    monkeypatch.chdir(tmp_path)
    assert git_commit().split("+")[0] == head


def test_no_commit_is_recorded_for_silo_pfl_installed_inside_another_projects_checkout(
    tmp_path,
):
    """A virtual environment inside a project's git checkout (ignored by it): git answered for
    that project, whose commit went into the tables and the cache as silo_pfl's."""
    project = tmp_path / "project"
    site = project / ".venv" / "site"
    shutil.copytree(ROOT / "silo_pfl", site / "silo_pfl", ignore=shutil.ignore_patterns("__py*"))
    (project / ".gitignore").write_text(".venv/\n")
    git = ["git", "-C", str(project), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(project)], check=True)
    subprocess.run([*git, "add", ".gitignore"], check=True)
    subprocess.run([*git, "commit", "-qm", "project"], check=True)
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "from silo_pfl.compare import git_commit; print(repr(git_commit()))",
        ],
        env={**os.environ, "PYTHONPATH": str(site)},
        cwd=project,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.stdout.strip() == "''", done.stderr[-2000:]


def _quick_or_dying(config: str, overrides: Sequence[str]) -> dict[str, Any]:
    """No run at all: local's candidates kill their worker after 2 s; fedavg's answer at once."""
    if any(item.startswith("train.lr=0.3") for item in overrides):
        time.sleep(2)
        os._exit(9)
    silos = {"a": {"val_accuracy": 0.5, "test_accuracy": 0.5}}
    result = {"mean_test_accuracy": 0.5, "wall_seconds": 0.1, "silos": silos}
    return {"result": result, "elapsed_seconds": 0.1}


def test_a_pool_that_breaks_between_two_waits_takes_no_comparison_down(tmp_path, monkeypatch):
    """fedavg's candidates answer; while the driver logs and caches them, local's workers die,
    and the pool is broken when fedavg's winner goes on to seed 1: submitting to it raised
    BrokenProcessPool out of the comparison, and no table was written."""
    monkeypatch.setattr(compare_module, "execute", _quick_or_dying)
    spec = parse_spec(
        {
            "jobs": {"heart": {"config": HEART, "seeds": [0, 1], "overrides": ["rounds=1"]}},
            "algorithms": {
                "fedavg": {"candidates": [["train.lr=0.05"], ["train.lr=0.06"]]},
                "local": {"candidates": [["train.lr=0.3"], ["train.lr=0.31"]]},
            },
        },
        str(tmp_path / "spec.yaml"),
    )
    successes: list[str] = []

    def log(line: str) -> None:
        if " test " in line:
            successes.append(line)
            if len(successes) == 2:
                time.sleep(3)  # local's workers die meanwhile

    outcome = compare(spec, 4, tmp_path / "cache", log=log)
    assert sorted(outcome.failed_runs) == sorted(
        f"heart local [train.lr={lr}] seed 0: {BROKEN_TWICE}" for lr in ("0.3", "0.31")
    )
    assert any("fedavg" in line and "seed 1" in line for line in successes), successes
