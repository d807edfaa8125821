"""`silo-pfl compare`: a tiny real comparison (two algorithms on heart disease, two rounds, two
worker processes with their own local Ray), its cache, its tables and JSON; the choice of
candidates on validation accuracy; bad specs as one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from silo_pfl.cli import main
from silo_pfl.compare import choose_candidate, load_spec, mean_val_accuracy, parse_spec
from silo_pfl.compare_table import BEGIN, END, gains, replace_region
from silo_pfl.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
HEART = str(ROOT / "jobs" / "heart_disease.yaml")


def write_spec(path: Path, fedavg: str = "{}") -> Path:
    path.write_text(
        "\n".join(
            [
                "jobs:",
                "  heart:",
                f"    config: {HEART}",
                "    seeds: [0]",
                "    overrides: [rounds=2, train.local_epochs=1]",
                "algorithms:",
                "  local: {}",
                f"  fedavg: {fedavg}",
            ]
        )
        + "\n"
    )
    return path


def compare(capsys, root: Path, spec: Path, *extra: str) -> tuple[int, str, str]:
    argv = [
        "compare",
        str(spec),
        "--workers",
        "2",
        "--cache",
        str(root / "cache"),
        "--out",
        str(root / "RESULTS.md"),
        "--json",
        str(root / "compare.json"),
        *extra,
    ]
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def cached_results(root: Path) -> dict[str, dict]:
    """Each cached run's results JSON, by its algorithm."""
    entries = [json.loads(p.read_text()) for p in (root / "cache").glob("*.json")]
    return {entry["config"]["algorithm"]["name"]: entry["result"] for entry in entries}


def test_a_comparison_runs_caches_and_writes_only_its_region(tmp_path, capfd):
    spec = write_spec(tmp_path / "spec.yaml")
    (tmp_path / "RESULTS.md").write_text(
        f"# Results\nkept above\n{BEGIN}\nold\n{END}\nkept below\n"
    )

    code, out, err = compare(capfd, tmp_path, spec)
    assert code == 0, err
    assert "2 runs computed, 0 from the cache" in out
    assert "Token authentication is enabled" not in err, err  # the workers' Ray says it not

    text = (tmp_path / "RESULTS.md").read_text()
    assert text.startswith("# Results\nkept above\n" + BEGIN + "\n")
    assert text.endswith(END + "\nkept below\n") and "\nold\n" not in text
    assert f"`silo-pfl compare {spec} " in text and f"--cache {tmp_path / 'cache'}" in text
    assert "### heart (" in text and "| local | the job's |" in text

    report = json.loads((tmp_path / "compare.json").read_text())
    rows = report["jobs"]["heart"]["algorithms"]
    results = cached_results(tmp_path)
    assert set(results) == {"local", "fedavg"}
    fedavg, local = results["fedavg"], results["local"]
    expected = {
        silo: 100 * (fedavg["silos"][silo]["test_accuracy"] - local["silos"][silo]["test_accuracy"])
        for silo in local["silos"]
    }
    gain = rows["fedavg"]["gain_over_baseline"]
    assert gain["per_silo_points"] == pytest.approx(expected)
    assert gain["mean_points"] == pytest.approx(sum(expected.values()) / len(expected))
    worst = min(expected, key=expected.get)
    assert (gain["worst_silo"], gain["worst_silo_points"]) == (
        worst,
        pytest.approx(expected[worst]),
    )
    assert f"| {gain['mean_points']:+.1f} | {expected[worst]:+.1f} ({worst}) |" in text
    assert rows["fedavg"]["mean_test_accuracy"]["mean"] == fedavg["mean_test_accuracy"]
    assert rows["fedavg"]["bytes_sent_per_round"] == fedavg["silos"]["va"]["bytes_sent_per_round"]
    assert rows["local"]["bytes_sent_per_round"] == 0
    assert rows["local"]["mean_val_accuracy"] == pytest.approx(mean_val_accuracy(local))

    # Nothing changed: no federation runs, the same figures come back.
    code, out, err = compare(capfd, tmp_path, spec)
    assert code == 0, err
    assert "0 runs computed, 2 from the cache" in out
    again = json.loads((tmp_path / "compare.json").read_text())
    assert again["jobs"] == report["jobs"] | {
        "heart": {
            **report["jobs"]["heart"],
            "algorithms": {
                name: {
                    **row,
                    "seeds": {s: {**v, "cached": True} for s, v in row["seeds"].items()},
                }
                for name, row in rows.items()
            },
        }
    }

    # One algorithm's override changes: only that algorithm runs again.
    write_spec(spec, "{candidates: [[train.lr=0.02]]}")
    code, out, err = compare(capfd, tmp_path, spec)
    assert code == 0, err
    assert "1 runs computed, 1 from the cache" in out
    assert "heart fedavg [train.lr=0.02] seed 0" in out
    assert "| fedavg | train.lr=0.02 |" in (tmp_path / "RESULTS.md").read_text()


def result(val: list[float], test: list[float]) -> dict:
    silos = {
        f"s{i}": {"val_accuracy": v, "test_accuracy": t}
        for i, (v, t) in enumerate(zip(val, test, strict=True))
    }
    return {"silos": silos, "mean_test_accuracy": sum(test) / len(test)}


def test_the_candidate_with_the_best_validation_accuracy_wins_whatever_its_test_accuracy():
    good_on_test = result(val=[0.70, 0.72], test=[0.95, 0.97])
    good_on_val = result(val=[0.80, 0.78], test=[0.60, 0.62])
    assert choose_candidate([good_on_test, good_on_val]) == 1
    assert choose_candidate([good_on_val, good_on_test]) == 0
    # The mean over silos decides, ties go to the first listed, failed runs never win.
    assert choose_candidate([result([0.9, 0.5], [0, 0]), result([0.7, 0.7], [1, 1])]) == 0
    assert choose_candidate([None, good_on_test]) == 1
    assert choose_candidate([None, None]) is None


def test_gains_are_per_silo_at_the_same_seed_then_averaged_over_seeds():
    row = {0: {"a": 0.8, "b": 0.6}, 1: {"a": 0.9, "b": 0.7}, 2: {"a": 1.0, "b": 1.0}}
    base = {0: {"a": 0.7, "b": 0.7}, 1: {"a": 0.7, "b": 0.8}}
    found = gains(row, base)
    assert found["seeds"] == [0, 1]  # seed 2 has no baseline
    assert found["per_silo_points"] == pytest.approx({"a": 15.0, "b": -10.0})
    assert found["mean_points"] == pytest.approx(2.5)
    assert (found["worst_silo"], found["worst_silo_points"]) == ("b", pytest.approx(-10.0))
    assert gains(row, {}) is None


def test_the_region_is_appended_when_absent_and_broken_markers_are_refused(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("# Title\ntext\n")
    replace_region(doc, "table 1\n")
    assert doc.read_text() == f"# Title\ntext\n\n{BEGIN}\ntable 1\n{END}\n"
    replace_region(doc, "table 2\n")
    assert doc.read_text() == f"# Title\ntext\n\n{BEGIN}\ntable 2\n{END}\n"
    doc.write_text(f"{END}\n{BEGIN}\n")
    with pytest.raises(ConfigError, match="expected one <!-- compare:begin --> line before"):
        replace_region(doc, "x\n")


def test_the_shipped_spec_covers_every_registered_algorithm():
    from silo_pfl.algorithms import ALGORITHMS

    spec = load_spec(ROOT / "jobs" / "compare" / "all.yaml")
    # The package's own algorithms (tests' plugins may have registered more in this process).
    shipped = {name for name, cls in ALGORITHMS.items() if cls.__module__.startswith("silo_pfl.")}
    assert {row.algorithm for row in spec.rows.values()} == shipped
    assert spec.rows["fedper_adapters"].overrides == (
        "model.adapter_dim=8",
        "split.local=[adapters]",
    )
    assert list(spec.jobs) == [
        "heart_disease",
        "digits_label_skew",
        "digits_dirichlet",
        "digits_concept_shift",
        "digits_feature_shift",
    ]


def test_max_seeds_keeps_each_jobs_first_seeds_only():
    spec = load_spec(ROOT / "jobs" / "compare" / "all.yaml")
    quick = spec.select(None, None, max_seeds=1)
    assert {label: job.seeds for label, job in quick.jobs.items()} == {
        label: job.seeds[:1] for label, job in spec.jobs.items()
    }
    assert spec.jobs["heart_disease"].seeds == (0, 1, 2) and quick.rows == spec.rows


@pytest.mark.parametrize(
    ("algorithms", "extra", "message"),
    [
        ("  fedmagic: {}", [], "algorithms.fedmagic on jobs.heart: algorithm.name: got 'fedmagic'"),
        ("  fedavg: {candidatez: [[]]}", [], "algorithms.fedavg.candidatez: unknown key; allowed:"),
        ("  fedavg: {candidates: []}", [], "algorithms.fedavg.candidates: expected a non-empty"),
        ("  fedavg: {overrides: [seed=3]}", [], "'seed=3': seed is set by the comparison itself"),
        (  # a section holding a reserved key, as a mapping: the baseline would run fedavg
            "  local: {candidates: [[], ['algorithm={name: fedavg}']]}",
            [],
            "'algorithm={name: fedavg}': algorithm holds algorithm.name, which is set by the "
            "comparison itself",
        ),
        ("  fedavg: {overrides: ['ray={address: x}']}", [], "'ray={address: x}': ray is set by"),
        (
            "  fedprox: {candidates: [[algorithm.fedprox.muu=1]]}",
            [],
            "algorithms.fedprox on jobs.heart with candidate [algorithm.fedprox.muu=1]: "
            "algorithm.fedprox.muu: unknown option of fedprox",
        ),
        ("  fedavg: {only_jobs: [digits]}", [], "names job 'digits', which is not in jobs (heart)"),
        ("  fedavg: {}", ["--jobs", "digits"], "--jobs: got 'digits', expected some of heart"),
        ("  fedavg: {}", ["--algorithms", "ditto"], "--algorithms: got 'ditto', expected some of"),
        ("  fedavg: {}", ["--workers", "0"], "--workers: got 0, expected an integer >= 1"),
        ("  fedavg: {}", ["--max-seeds", "0"], "--max-seeds: got 0, expected >= 1"),
    ],
)
def test_bad_input_is_one_line_naming_it(tmp_path, capsys, algorithms, extra, message):
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        f"baseline: null\njobs:\n  heart:\n    config: {HEART}\nalgorithms:\n{algorithms}\n"
    )
    code, _, err = compare(capsys, tmp_path, spec, *extra)
    assert code == 2, err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert message in err
    assert not (tmp_path / "cache").exists() and not (tmp_path / "compare.json").exists()


def test_a_missing_job_file_or_spec_is_named_and_debug_shows_the_traceback(tmp_path, capsys):
    spec = tmp_path / "spec.yaml"
    spec.write_text("jobs:\n  heart:\n    config: nowhere.yaml\nalgorithms:\n  local: {}\n")
    code, _, err = compare(capsys, tmp_path, spec)
    assert code == 2 and err == "error: jobs.heart.config: config file nowhere.yaml: not found\n"
    code, _, err = compare(capsys, tmp_path, tmp_path / "none.yaml")
    assert code == 2 and err.startswith(f"error: config file {tmp_path / 'none.yaml'}: not found")
    code, _, err = compare(capsys, tmp_path, spec, "--debug")
    assert code == 2 and "Traceback" in err


def test_the_default_spec_outside_the_repository_says_where_it_looked(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    assert main(["compare", "--dry-run"]) == 2
    assert capsys.readouterr().err == (
        f"error: spec: no jobs/compare/all.yaml in {tmp_path}; the default spec and outputs are "
        "the repository's, relative to the working directory: run silo-pfl compare from the "
        "repository's root, or name a spec\n"
    )


def test_a_spec_mapping_is_checked_before_any_job_is_read():
    with pytest.raises(ConfigError, match="spec: jobs: required key is missing"):
        parse_spec({"algorithms": {"local": {}}})
    with pytest.raises(ConfigError, match=r"jobs.a.seeds: expected distinct integers >= 0"):
        parse_spec({"jobs": {"a": {"config": "x.yaml", "seeds": [0, 0]}}, "algorithms": {"b": {}}})
    with pytest.raises(ConfigError, match="baseline: got 'local', expected one of the algorithms"):
        parse_spec({"jobs": {"a": {"config": "x.yaml"}}, "algorithms": {"b": {}}})
