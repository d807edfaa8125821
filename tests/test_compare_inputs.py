"""`silo-pfl compare` on awkward inputs, in process and without federations: silos without
validation rows (NaN in memory, null in the cache), rows whose silos differ from the baseline's,
a CSV job's files in the cache key, and the progress counter. The results are written into the
cache as a run would write them, so `compare` reads every run from it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from silo_pfl import compare_table
from silo_pfl.compare import (
    NO_VALIDATION,
    Outcome,
    choose_candidate,
    compare,
    known_total,
    mean_val_accuracy,
    parse_spec,
    plan,
    progress_label,
)
from silo_pfl.compare_runs import Cache, Record, make_run, remove_tree

ROOT = Path(__file__).resolve().parents[1]
HEART = str(ROOT / "jobs" / "heart_disease.yaml")
NAN = float("nan")


def result(val: dict[str, float | None], test: dict[str, float]) -> dict:
    silos = {
        s: {"val_accuracy": val[s], "test_accuracy": t, "bytes_sent_per_round": 100}
        for s, t in test.items()
    }
    mean = sum(test.values()) / len(test)
    return {
        "silos": silos,
        "mean_test_accuracy": mean,
        "worst_test_accuracy": min(test.values()),
        "std_test_accuracy": 0.0,
        "wall_seconds": 1.0,
    }


def test_silos_without_validation_figures_are_left_out_of_the_mean():
    assert mean_val_accuracy(result({"a": 0.8, "b": NAN}, {"a": 0, "b": 0})) == 0.8
    assert mean_val_accuracy(result({"a": 0.8, "b": None}, {"a": 0, "b": 0})) == 0.8
    assert mean_val_accuracy(result({"a": NAN, "b": None}, {"a": 0, "b": 0})) is None


def test_a_candidate_without_a_validation_figure_never_wins_and_none_at_all_chooses_nothing():
    worse = result({"a": 0.5, "b": NAN}, {"a": 0.9, "b": 0.9})
    better = result({"a": 0.9, "b": None}, {"a": 0.1, "b": 0.1})
    blind = result({"a": NAN, "b": None}, {"a": 1.0, "b": 1.0})
    assert choose_candidate([worse, better]) == 1
    assert choose_candidate([blind, worse]) == 1
    assert choose_candidate([None, blind]) == 1  # the only run: nothing to choose between
    assert choose_candidate([blind, blind]) is None  # a choice would be blind


def cached_comparison(tmp_path: Path, spec: dict, results: dict) -> tuple:
    """`compare` with every run's results put in the cache first (NaN written as null, as a
    run's are); `results[(row, candidate index)]` gives a run's results."""
    spec = parse_spec(spec, str(tmp_path / "spec.yaml"))
    cache = Cache(tmp_path / "cache")
    units, _ = plan(spec)
    for unit in units:
        for index, run in enumerate(unit.first):
            cache.put(run, Record(results[unit.row.label, index], elapsed_seconds=1.0))
    lines: list[str] = []
    outcome = compare(spec, 1, tmp_path / "cache", log=lines.append)
    assert outcome.computed == 0 and outcome.cached == len(results)
    data = compare_table.report(outcome, "silo-pfl compare", "cache", "out.json")
    return outcome, data, compare_table.markdown(data), lines


def test_a_comparison_of_silos_without_validation_rows_reads_back_from_the_cache(tmp_path):
    spec = {
        "baseline": "local",
        "jobs": {"heart": {"config": HEART, "seeds": [0]}},
        "algorithms": {
            "local": {},
            "fedavg": {"candidates": [["train.lr=0.01"], ["train.lr=0.1"]]},
            "ditto": {"candidates": [["train.lr=0.01"], ["train.lr=0.1"]]},
        },
    }
    results = {
        ("local", 0): result({"a": 0.6, "b": NAN}, {"a": 0.5, "b": 0.5}),
        ("fedavg", 0): result({"a": 0.6, "b": NAN}, {"a": 0.3, "b": 0.3}),
        ("fedavg", 1): result({"a": 0.8, "b": NAN}, {"a": 0.9, "b": 0.8}),
        ("ditto", 0): result({"a": NAN, "b": NAN}, {"a": 0.3, "b": 0.3}),
        ("ditto", 1): result({"a": NAN, "b": NAN}, {"a": 0.9, "b": 0.9}),
    }
    outcome, data, text, lines = cached_comparison(tmp_path, spec, results)
    rows = data["jobs"]["heart"]["algorithms"]
    assert rows["fedavg"]["chosen"] == ["train.lr=0.1"]
    assert rows["fedavg"]["mean_val_accuracy"] == pytest.approx(0.8)
    assert rows["local"]["mean_val_accuracy"] == pytest.approx(0.6)
    assert rows["ditto"]["chosen"] is None and rows["ditto"]["error"] == NO_VALIDATION
    assert lines == [f"heart ditto: {NO_VALIDATION}"]
    assert outcome.failures == [f"heart ditto: {NO_VALIDATION}"]
    assert outcome.failure_line() == (  # its runs finished: none is counted as failed
        f"error: 1 row chose no candidate (shown in the tables): heart ditto: {NO_VALIDATION}"
    )
    assert "nan" not in text.lower()
    assert "train.lr=0.01 (val n/a), **train.lr=0.1** (val 0.8000)" not in text
    assert "train.lr=0.01 (val 0.6000), **train.lr=0.1** (val 0.8000)" in text
    assert f"failed: {NO_VALIDATION}" in text


def test_gains_are_over_the_silos_the_row_and_the_baseline_both_have(tmp_path):
    spec = {
        "baseline": "local",
        "jobs": {"heart": {"config": HEART, "seeds": [0]}},
        "algorithms": {"local": {}, "fedavg": {}},
    }
    results = {
        ("local", 0): result({"a": 0.6, "b": 0.6}, {"a": 0.5, "b": 0.5}),
        ("fedavg", 0): result({"a": 0.6, "c": 0.6}, {"a": 0.7, "c": 0.9}),
    }
    _, data, text, _ = cached_comparison(tmp_path, spec, results)
    gain = data["jobs"]["heart"]["algorithms"]["fedavg"]["gain_over_baseline"]
    assert gain["per_silo_points"] == pytest.approx({"a": 20.0})
    assert gain["silos_not_compared"] == ["b", "c"]
    assert "| +20.0 (not: b, c) | +20.0 (a) |" in text
    assert compare_table.gains({0: {"c": 0.5}}, {0: {"a": 0.5}}) is None


def csv_spec(paths: dict[str, Path]) -> dict:
    where = [f"data.paths.{silo}={path}" for silo, path in paths.items()]
    overrides = ["data={source: csv, num_classes: 2, label_column: label}", *where]
    return {
        "baseline": None,
        "jobs": {"csv": {"config": HEART, "seeds": [0], "overrides": overrides}},
        "algorithms": {"local": {}},
    }


def test_a_csv_jobs_cache_key_holds_its_files_contents(tmp_path):
    paths = {"a": tmp_path / "a.csv", "b": tmp_path / "b.csv"}
    for path in paths.values():
        path.write_text("x,label\n1,0\n2,1\n3,0\n4,1\n")
    spec = parse_spec(csv_spec(paths), str(tmp_path / "spec.yaml"))
    job, row = spec.jobs["csv"], spec.rows["local"]

    def run():
        return make_run(job, row, (), 0)

    first = run()
    assert run().key == first.key and first.cacheable
    Cache(tmp_path / "cache").put(first, Record({"silos": {}}, elapsed_seconds=1.0))
    lines: list[str] = []
    compare(spec, 1, tmp_path / "cache", log=lines.append, dry_run=True)
    assert lines == ["0 runs to compute, 1 from the cache"]

    paths["b"].write_text("x,label\n1,1\n2,0\n3,1\n4,0\n")  # the same size, other labels
    edited = run()
    assert edited.key != first.key and edited.cacheable

    paths["b"].unlink()
    gone = run()
    assert not gone.cacheable and gone.hashed["data_files"]["b"] is None
    Cache(tmp_path / "cache").put(gone, Record({"silos": {}}, elapsed_seconds=1.0))
    lines.clear()
    compare(spec, 1, tmp_path / "cache", log=lines.append, dry_run=True)
    assert lines[-1] == "1 runs to compute, 0 from the cache"


def test_the_progress_total_is_given_only_when_known_before_any_run(tmp_path):
    def units(seeds: list[int], candidates: list[list[str]]):
        spec = parse_spec(
            {
                "baseline": None,
                "jobs": {"heart": {"config": HEART, "seeds": seeds}},
                "algorithms": {"fedavg": {"candidates": candidates}},
            },
            str(tmp_path / "spec.yaml"),
        )
        return plan(spec)[0]

    # Two candidates on two seeds: the winner's second seed is queued later.
    assert known_total(units([0, 1], [["train.lr=0.1"], ["train.lr=0.2"]]), 2) is None
    assert known_total(units([0], [["train.lr=0.1"], ["train.lr=0.2"]]), 2) == 2
    decided = units([0, 1], [[]])
    decided[0].decided = True
    assert known_total(decided, 2) == 2
    assert progress_label(3, None) == "[3]" and progress_label(3, 8) == "[3/8]"


def test_a_row_of_one_candidate_queues_every_seed_at_once(tmp_path):
    """Nothing to choose: all its seeds are counted (and run) from the start, so the progress
    has its total; a row of two candidates still waits for its choice."""
    spec = parse_spec(
        {
            "baseline": None,
            "jobs": {"heart": {"config": HEART, "seeds": [0, 1, 2]}},
            "algorithms": {
                "fedavg": {},
                "ditto": {"candidates": [["train.lr=0.1"], ["train.lr=0.2"]]},
            },
        },
        str(tmp_path / "spec.yaml"),
    )
    lines: list[str] = []
    compare(spec, 1, tmp_path / "cache", log=lines.append, dry_run=True)
    assert lines[-1] == (
        "5 runs to compute, 0 from the cache; then up to 2 more once 1 choices are made"
    )
    fedavg = [x for x in lines if x.startswith("would run: heart fedavg seed ")]
    assert len(fedavg) == 3, lines


def test_a_row_whose_every_seed_failed_says_so(tmp_path):
    """A row of one candidate runs every seed at once, so its first seed may fail beside others
    that ran: each failed seed is named, and a row with none left says every seed failed."""
    spec = parse_spec(
        {
            "baseline": None,
            "jobs": {"heart": {"config": HEART, "seeds": [0, 1]}},
            "algorithms": {"fedavg": {}},
        },
        str(tmp_path / "spec.yaml"),
    )
    (unit,) = plan(spec)[0]
    unit.chosen, unit.decided = 0, True
    unit.seeds = [unit.first[0], make_run(unit.job, unit.row, (), 1)]
    records = {run.key: Record(None, f"DataError: seed {run.seed}") for run in unit.seeds}
    row = compare_table._row(unit, records, {})
    assert row["error"] == "every seed failed (each one's error below)"
    assert row["failed_seeds"] == {"0": "DataError: seed 0", "1": "DataError: seed 1"}


def test_a_row_with_a_failed_seed_is_ranked_after_the_complete_rows_and_names_its_seeds(tmp_path):
    """Its mean is over the seeds that finished, which may be the easy ones: it is not ranked
    (nor set in bold) above rows that have every seed, and its mean says which seeds it holds."""
    spec = parse_spec(
        {
            "baseline": None,
            "jobs": {"heart": {"config": HEART, "seeds": [0, 1]}},
            "algorithms": {"fedavg": {}, "scaffold": {}},
        },
        str(tmp_path / "spec.yaml"),
    )
    units = plan(spec)[0]
    scores = {("fedavg", 0): 0.70, ("fedavg", 1): 0.72, ("scaffold", 0): 0.95}
    records = {}
    for unit in units:
        unit.chosen, unit.decided = 0, True
        unit.seeds = [unit.first[0], make_run(unit.job, unit.row, (), 1)]
        for run in unit.seeds:
            score = scores.get((unit.row.label, run.seed))
            records[run.key] = (
                Record(result({"a": score, "b": score}, {"a": score, "b": score}))
                if score is not None
                else Record(None, "FederationError: training diverged")
            )
    rows = {unit.row.label: compare_table._row(unit, records, {}) for unit in units}
    job = {"config": HEART, "seeds": [0, 1], "overrides": [], "baseline": None}
    job.update(algorithms=rows, not_run={}, published=None)
    table = [line for line in compare_table._job_table("heart", job) if line.startswith("| ")]
    names = [line.split(" | ")[0][2:] for line in table[1:]]
    assert names == ["fedavg", "scaffold"]
    assert "| **0.7100 ± 0.0100** |" in table[1]
    assert "| 0.9500 (seed 0 only) |" in table[2]
    outcome = Outcome(spec, units, records, {}, 0, 3, 1.0, 1)
    assert outcome.failure_line() == (
        "error: 1 run failed (shown in the tables): heart scaffold seed 1: "
        "FederationError: training diverged"
    )


def descendants(pid: int) -> set[int]:
    """Every process below `pid` (its children, theirs, ...), from /proc."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_run_directory_still_written_to_by_stopping_actors_is_deleted(tmp_path):
    """A released actor's process may write a checkpoint for a moment after the run stopped:
    the worker's deletion of the run directory waits that out rather than leave it half-deleted
    (a single rmtree fails with 'directory not empty')."""
    run = tmp_path / "silo_pfl_compare_x"
    stop = time.monotonic() + 1.0

    def write_checkpoints() -> None:
        n = 0
        while time.monotonic() < stop:
            n += 1
            try:
                directory = run / "fed" / "r1" / "silos" / f"s{n % 4}"
                directory.mkdir(parents=True, exist_ok=True)
                (directory / f"round_{n}.pt").write_bytes(b"x" * 4096)
            except OSError:
                pass

    writer = threading.Thread(target=write_checkpoints)
    writer.start()
    try:
        time.sleep(0.1)
        remove_tree(run)
    finally:
        writer.join()
    assert not run.exists()


def test_sigterm_stops_the_workers_their_ray_and_deletes_the_runs_directory(tmp_path):
    """SIGTERM to `silo-pfl compare` (a CI timeout, `kill`) while a federation runs: exit 143
    with one line, no worker or Ray process left, no temporary run directory left."""
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        f"baseline: null\njobs:\n  heart:\n    config: {HEART}\n    seeds: [0]\n"
        "    overrides: [rounds=500]\nalgorithms:\n  fedavg: {}\n"
    )
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    ray_tmp = Path(tempfile.mkdtemp(prefix="cf", dir="/tmp"))  # Ray's socket paths are short
    env = {**os.environ, "TMPDIR": str(tmp), "RAY_TMPDIR": str(ray_tmp)}
    command = [str(Path(sys.executable).parent / "silo-pfl"), "compare", str(spec)]
    command += ["--workers", "1", "--cache", str(tmp_path / "cache")]
    command += ["--out", str(tmp_path / "o.md"), "--json", str(tmp_path / "o.json")]
    err_path = tmp_path / "stderr"
    below: set[int] = set()
    with open(err_path, "w") as err_file:  # not a pipe: a leaked worker would hold it open
        process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=err_file)
    try:
        deadline = time.monotonic() + 180
        while not list(tmp.glob("silo_pfl_compare_*/*/*/server")):  # a round checkpointed
            assert process.poll() is None, err_path.read_text()
            assert time.monotonic() < deadline, "the federation did not start"
            time.sleep(0.5)
        below = descendants(process.pid)
        assert below
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=150)
        err = err_path.read_text()
        assert process.returncode == 143, err
        assert err.strip().splitlines()[-1] == "error: stopped by SIGTERM", err
        deadline = time.monotonic() + 60
        while any(alive(pid) for pid in below) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not [pid for pid in below if alive(pid)]
        assert not list(tmp.glob("silo_pfl_compare_*")), list(tmp.rglob("*"))[:5]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        for pid in below:  # what a failed run of this test left: the worker stops its Ray
            if alive(pid):
                os.kill(pid, signal.SIGTERM)
        shutil.rmtree(ray_tmp, ignore_errors=True)


def test_whether_silos_report_counts_per_class_is_not_in_the_cache_key(tmp_path):
    """privacy.label_counts changes what leaves a silo, not its results: the cache keys made
    before the key existed still hold."""
    spec = parse_spec(
        {
            "baseline": None,
            "jobs": {"heart": {"config": HEART, "seeds": [0]}},
            "algorithms": {"fedavg": {}},
        },
        str(tmp_path / "spec.yaml"),
    )
    job, row = spec.jobs["heart"], spec.rows["fedavg"]
    plain = make_run(job, row, (), 0)
    assert make_run(job, row, ("privacy.label_counts=false",), 0).key == plain.key
    assert make_run(job, row, ("train.lr=0.5",), 0).key != plain.key
