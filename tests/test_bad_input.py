"""Bad input of every kind is one line on stderr, `error: <message>`, naming the config key, the
silo or the file and what is allowed, with no traceback.

Config errors fail before Ray starts. Data and split errors fail inside a silo (its set-up or its
build), so those tests run a one-round federation on the shared local Ray and stop at that silo.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from silo_pfl.cli import main
from silo_pfl.data.base import assemble
from silo_pfl.data.heart_disease import RAW_COLUMNS, read_complete_rows
from silo_pfl.errors import DataError

HEART_JOB = "jobs/heart_disease.yaml"  # four hospitals, fedper


def heart_rows(silo: str, count: int = 60) -> list[list[str]]:
    """A header and the first `count` complete rows of a hospital, as cluster/hospital_data.py
    writes them: the ten raw columns, then `label` (0: no disease, 1: disease)."""
    features, labels = read_complete_rows(silo)
    rows = [
        [f"{v:g}" for v in row] + [str(int(y))] for row, y in zip(features, labels, strict=True)
    ]
    return [[*RAW_COLUMNS, "label"], *rows[:count]]


def write_csv(path: Path, rows: list[list[str]]) -> Path:
    path.write_text("".join(",".join(row) + "\n" for row in rows))
    return path


def csv_job(tmp_path: Path, hungarian: Path | None, *lines: str) -> Path:
    """A CSV job of two hospitals: cleveland's file is good, hungarian's is the one under test
    (without it, cleveland alone)."""
    cleveland = write_csv(tmp_path / "cleveland.csv", heart_rows("cleveland"))
    paths = [f"    cleveland: {cleveland}"] + ([f"    hungarian: {hungarian}"] if hungarian else [])
    job = tmp_path / "job.yaml"
    job.write_text(
        "\n".join(
            [
                "name: bad_input",
                "rounds: 1",
                "data:",
                "  source: csv",
                "  num_classes: 2",
                "  paths:",
                *paths,
                "model: {name: mlp, hidden: [8]}",
                "algorithm: {name: fedavg}",
                *lines,
            ]
        )
        + "\n"
    )
    return job


def run(capsys, tmp_path: Path, config: str | Path, *overrides: str, tracked: bool = False):
    """`silo-pfl run` in this process; its exit code, stdout and stderr."""
    tracking = [] if tracked else ["tracking.enabled=false"]
    argv = ["run", str(config), *overrides, f"output_dir={tmp_path / 'runs'}", *tracking]
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def no_run_left(tmp_path: Path) -> bool:
    """A run that failed before its first checkpoint left no directory for --resume to find,
    nor the output_dir (tmp_path/runs) and federation directory it made for it."""
    return not (tmp_path / "runs").exists()


def assert_one_line(code: int, err: str, expected_code: int, *parts: str) -> str:
    """Exit code, and stderr exactly one line `error: ...` holding every part; the message."""
    assert code == expected_code, err
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1 and err.endswith("\n"), err
    assert lines[0].startswith("error: "), err
    missing = [part for part in parts if part not in lines[0]]
    assert not missing, f"{missing} not in {lines[0]!r}"
    return lines[0].removeprefix("error: ")


# 1., 2. The config file: malformed, missing, or not a file.


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "name: x\nrounds: [1, 2\n",
            "not valid YAML at line 3, column 1: did not find expected ',' or ']' (while "
            "parsing a flow sequence started on line 2)",
        ),
        ("name: x\n  rounds: 1\n", "not valid YAML at line 2, column 9: mapping values are not"),
        ("- name: x\n", "expected a mapping of keys at the top level"),
        ("name: no\n", 'name: no reads as a boolean in YAML; quote it: name: "no"'),
        ("name: x\nseed: 010\n", "seed: 010 reads as 8 in YAML (not decimal); write the number"),
        (
            "name: x\ndata: {source: csv, num_classes: 2, paths: {no: /data/no.csv}}\n",
            "key 'data.paths.no' reads as a bool in YAML, not as the name it spells; quote it",
        ),
        (
            "name: x\ntrain.lr: 0.3\n",
            "key 'train.lr' holds a dot; in a file write it nested (train: {lr: ...}); dotted "
            "keys are for key=value overrides",
        ),
    ],
    ids=["unclosed-list", "bad-indent", "not-a-mapping", "name-no", "octal", "silo-no", "dotted"],
)
def test_malformed_yaml_names_the_file_and_the_line(tmp_path, capsys, text, expected):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    code, out, err = run(capsys, tmp_path, path)
    assert_one_line(code, err, 2, f"config file {path}: {expected}")
    assert out == "" and not (tmp_path / "runs").exists()


def test_missing_config_file(tmp_path, capsys):
    path = tmp_path / "nowhere.yaml"
    code, _, err = run(capsys, tmp_path, path)
    assert assert_one_line(code, err, 2) == f"config file {path}: not found"


def test_directory_as_config_file(tmp_path, capsys):
    code, _, err = run(capsys, tmp_path, tmp_path)
    message = assert_one_line(code, err, 2)
    assert message == f"config file {tmp_path}: is a directory, expected a YAML file"


def test_a_pipe_or_an_empty_path_as_config_file_says_so(tmp_path, capsys):
    """A FIFO (what `<(...)` gives) exists: "not found" would send the user looking for it."""
    fifo = tmp_path / "job.fifo"
    os.mkfifo(fifo)
    code, _, err = run(capsys, tmp_path, fifo)
    assert assert_one_line(code, err, 2) == (
        f"config file {fifo}: not a regular file (a pipe or a device, which a run may read more "
        "than once); write the YAML to a file and give its path"
    )
    code, _, err = run(capsys, tmp_path, "")
    assert assert_one_line(code, err, 2) == (
        "silo-pfl run: CONFIG: got '', expected a YAML file's path (see silo-pfl run --help)"
    )


def test_config_file_that_is_not_text(tmp_path, capsys):
    path = tmp_path / "binary.yaml"
    path.write_bytes(b"name: \xff\xfe\n")
    code, _, err = run(capsys, tmp_path, path)
    assert assert_one_line(code, err, 2) == f"config file {path}: is not a UTF-8 text file"


# 7. Two silos with the same name: one key written twice in the YAML.


def test_a_silo_named_twice_in_the_yaml(tmp_path, capsys):
    good = write_csv(tmp_path / "a.csv", heart_rows("cleveland"))
    job = csv_job(tmp_path, good)
    text = job.read_text().replace(f"    hungarian: {good}\n", f"    cleveland: {good}\n")
    job.write_text(text)
    code, out, err = run(capsys, tmp_path, job)
    message = assert_one_line(code, err, 2)
    assert message == (
        f"config file {job}: key data.paths.cleveland appears twice (lines 7 and 8); each key "
        "may appear only once"
    )
    assert out == ""


def test_a_top_level_key_written_twice(tmp_path, capsys):
    path = tmp_path / "twice.yaml"
    path.write_text("name: a\nrounds: 1\ndata:\n  source: digits\nrounds: 2\n")
    code, _, err = run(capsys, tmp_path, path)
    assert_one_line(code, err, 2, f"config file {path}: key rounds appears twice (lines 2 and 5)")


# 6. (config) A CSV federation must declare its classes; other sources must not.


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["data.num_classes=null"],
            "data.num_classes: required for data.source=csv; set it to the number of classes C "
            "(labels are 0..C-1), e.g. data.num_classes=2",
        ),
        (["data.num_classes=1"], "data.num_classes: got 1, expected an integer from 2 to 100000"),
        (["data.num_classes=two"], "data.num_classes: got 'two', expected a value of type integer"),
    ],
    ids=["missing", "one", "not-an-integer"],
)
def test_csv_needs_num_classes(tmp_path, capsys, overrides, expected):
    job = csv_job(tmp_path, write_csv(tmp_path / "h.csv", heart_rows("hungarian")))
    code, out, err = run(capsys, tmp_path, job, *overrides)
    assert assert_one_line(code, err, 2) == expected
    assert out == "" and not (tmp_path / "runs").exists()


def test_num_classes_is_refused_by_other_sources(tmp_path, capsys):
    code, _, err = run(capsys, tmp_path, HEART_JOB, "data.num_classes=2")
    message = assert_one_line(code, err, 2)
    assert message.startswith(
        "data.num_classes: not an option of data.source=heart_disease; its options"
    )


# 8. A quorum larger than the federation.


@pytest.mark.parametrize("quorum", [5, 0])
def test_min_silos_beyond_the_number_of_silos(tmp_path, capsys, quorum):
    code, out, err = run(capsys, tmp_path, HEART_JOB, f"round.min_silos={quorum}")
    message = assert_one_line(code, err, 2)
    assert message == (
        f"round.min_silos: got {quorum}, expected 1 to 4 (the number of silos), or null for "
        "every silo"
    )
    assert out == "" and not (tmp_path / "runs").exists()


def test_a_key_file_that_is_not_text_or_lists_no_silo_is_refused_at_load(tmp_path, capsys):
    """An empty key file named on purpose would fall back to trusting the keys the silos report
    (the driver relays them): refused, as a binary one is."""
    binary, empty = tmp_path / "keys.bin", tmp_path / "keys.txt"
    binary.write_bytes(b"\xbd\xff\x00")
    empty.write_text("# no silo yet\n")
    for path, reason in ((binary, "is not a UTF-8 text file"), (empty, "lists no silo; list")):
        option = f"aggregation.identity_keys={path}"
        code, out, err = run(capsys, tmp_path, HEART_JOB, "aggregation.secure=true", option)
        message = assert_one_line(code, err, 2)
        assert message.startswith(f"aggregation.identity_keys: {path} {reason}"), message
        assert out == "" and not (tmp_path / "runs").exists()


def test_results_that_name_the_job_file_are_refused_before_the_run(tmp_path, capsys):
    """A slip of the shell (`--results job.yaml`) would overwrite the job with its results."""
    job = tmp_path / "job.yaml"
    job.write_text(Path(HEART_JOB).read_text())
    code, out, err = run(capsys, tmp_path, job, "--results", str(job))
    assert assert_one_line(code, err, 2) == (
        f"--results {job}: is the job's config file; name another path"
    )
    assert job.read_text() == Path(HEART_JOB).read_text() and out == ""


@pytest.mark.parametrize(
    ("option", "key", "reason"),
    [
        ("round.min_silos=2", "round.min_silos", "got 2, but a secure round needs 3 silos"),
        ("aggregation.max_update_norm=1.0", "aggregation.max_update_norm", "cannot be checked"),
        ("aggregation.max_extra_norm=1.0", "aggregation.max_extra_norm", "cannot be checked"),
        (
            "aggregation.secure_threshold=2",
            "aggregation.secure_threshold",
            "got 2, expected 3 to 4 (a majority of the 4 silos",
        ),
        ("aggregation.secure_threshold=5", "aggregation.secure_threshold", "got 5, expected 3"),
        (
            "aggregation.secure_graph.neighbors=1",
            "aggregation.secure_graph.neighbors",
            "got 1, expected an integer >= 2",
        ),
        ("aggregation.clip=0", "aggregation.clip", "got 0"),
        (
            "silos.va.identity_key=bm90IGEga2V5",
            "silos.cleveland.identity_key",
            "missing; list every silo's public identity key",
        ),
        (
            "aggregation.identity_keys=/nonexistent/keys.txt",
            "aggregation.identity_keys",
            "cannot read /nonexistent/keys.txt",
        ),
    ],
)
def test_what_secure_aggregation_cannot_do_is_refused_at_load(
    tmp_path, capsys, option, key, reason
):
    code, out, err = run(capsys, tmp_path, HEART_JOB, "aggregation.secure=true", option)
    message = assert_one_line(code, err, 2)
    assert message.startswith(f"{key}: {reason}")
    assert out == "" and not (tmp_path / "runs").exists()


# 3., 4., 6. (data) A silo's file: missing, unreadable, not numeric, empty, labels out of range.
# Each fails in that silo's set-up, inside a Ray actor.


def _cells(row: int, column: int, value: str) -> Callable[[Path], Path]:
    """A hungarian file whose data row `row` has `value` in column `column`."""

    def make(tmp_path: Path) -> Path:
        rows = heart_rows("hungarian")
        rows[row][column] = value
        return write_csv(tmp_path / "hungarian.csv", rows)

    return make


def _directory(tmp_path: Path) -> Path:
    (tmp_path / "hungarian.csv").mkdir()
    return tmp_path / "hungarian.csv"


def _unreadable(tmp_path: Path) -> Path:
    path = write_csv(tmp_path / "hungarian.csv", heart_rows("hungarian"))
    path.chmod(0)
    return path


def _latin1(tmp_path: Path) -> Path:
    path = tmp_path / "hungarian.csv"
    path.write_bytes(b"age,label\n" + "61,0\nM\u00fcnchen,1\n".encode("latin-1"))
    return path


def _empty(tmp_path: Path) -> Path:
    (tmp_path / "hungarian.csv").write_text("")
    return tmp_path / "hungarian.csv"


AS_ROOT = pytest.mark.skipif(
    hasattr(os, "geteuid") and os.geteuid() == 0, reason="root reads a file whatever its mode"
)

DATA_CASES = [
    pytest.param(
        lambda tmp_path: tmp_path / "missing.csv",
        "missing.csv: not found (set data.paths.hungarian to an existing CSV file)",
        id="missing",
    ),
    pytest.param(
        _directory,
        "hungarian.csv: is a directory (set data.paths.hungarian to a CSV file)",
        id="dir",
    ),
    pytest.param(
        _unreadable,
        "hungarian.csv: cannot be read (Permission denied)",
        id="mode-000",
        marks=AS_ROOT,
    ),
    pytest.param(_latin1, "hungarian.csv: is not a UTF-8 text file", id="not-utf8"),
    pytest.param(
        _cells(3, 0, "sixty"),
        "hungarian.csv: column 'age', data row 3 (line 4): not a finite number",
        id="non-numeric",
    ),
    pytest.param(
        _cells(5, 4, "NaN"),
        "hungarian.csv: column 'chol', data row 5 (line 6): not a finite number",
        id="nan-feature",
    ),
    pytest.param(
        _empty,
        "hungarian.csv: is empty; expected a header row, then one row per example",
        id="empty",
    ),
    pytest.param(
        _cells(7, -1, "2"),
        "hungarian.csv: label column 'label', data row 7 (line 8): not a class index; "
        "labels must be integers 0..1 (data.num_classes=2)",
        id="label-out-of-range",
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize(("make", "expected"), DATA_CASES)
def test_bad_silo_file_is_one_line_naming_silo_and_file(
    ray_local, tmp_path, capsys, make, expected
):
    path = make(tmp_path)
    code, out, err = run(capsys, tmp_path, csv_job(tmp_path, path))
    message = assert_one_line(code, err, 1)
    assert message == f"silo hungarian, file {tmp_path}/{expected}"
    assert "round 1" not in out
    assert no_run_left(tmp_path)


@pytest.mark.slow
def test_a_failed_tracked_run_registers_no_model(ray_local, tmp_path, capsys, mlflow_store):
    """Nothing half-written is left in the model registry when a silo's data is bad."""
    from mlflow import MlflowClient

    job = csv_job(tmp_path, _cells(7, -1, "5")(tmp_path))
    code, out, err = run(capsys, tmp_path, job, tracked=True)
    assert_one_line(code, err, 1, "silo hungarian", "labels must be integers 0..1")
    client = MlflowClient(mlflow_store)
    assert client.search_registered_models() == []
    # Refused as the silos set up, before the run's MLflow run: no experiment, no run is made.
    assert [e.name for e in client.search_experiments()] == ["Default"]
    assert client.search_runs([e.experiment_id for e in client.search_experiments()]) == []
    assert "round 1" not in out


# 9. Split rules that leave no global keys, or no local keys, where the algorithm needs them.
# The split needs the model, whose input width comes from the data: each silo checks it at build.
# One silo: with several, every silo raises, and on a Ray that outlives the run the driver logs
# the errors it never fetched ("Unhandled error") to stderr after the CLI's line.

SPLIT_CASES = [
    pytest.param(
        ["algorithm.name=fedper", "split.local=[all]"],
        "split.local: split.local=[all] leaves no global keys, so algorithm fedper has nothing to "
        "federate; keep some keys global (e.g. split.local=[head]), or use algorithm.name=local to "
        "train each silo alone",
        id="fedper-all-local",
    ),
    pytest.param(
        ["algorithm.name=fedrep", "split.local=[]"],
        "split.local: split.local=[] leaves no local keys, but algorithm fedrep trains or keeps "
        "personal (local) keys; name some (e.g. split.local=[head]), or use an algorithm without "
        "them, e.g. algorithm.name=fedavg",
        id="fedrep-nothing-local",
    ),
    pytest.param(
        ["algorithm.name=finetune", "algorithm.finetune.trainable=local"],
        "split.local: split.local=[] leaves no local keys, but algorithm finetune trains",
        id="finetune-local-without-local-keys",
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize(("overrides", "expected"), SPLIT_CASES)
def test_split_without_the_keys_the_algorithm_needs(
    ray_local, tmp_path, capsys, overrides, expected
):
    code, out, err = run(capsys, tmp_path, csv_job(tmp_path, None), *overrides)
    assert assert_one_line(code, err, 2).startswith(expected)
    assert "round 1" not in out
    assert no_run_left(tmp_path)


# 5. A silo left with no rows to train on. `holdout` always leaves a row behind, so no fractions
# of the shipped sources get here; a source that hands `assemble` no training rows does.


def test_a_silo_with_no_training_rows():
    x, y = np.zeros((3, 2)), np.array([0, 1, 0])
    with pytest.raises(DataError) as info:
        assemble("clinic", x, y, np.array([], dtype=np.int64), np.arange(3), 0.2, 0, None, "/d.csv")
    assert str(info.value) == (
        "silo clinic, file /d.csv: no rows left to train on (3 rows: 3 held out for test by "
        "data.test_fraction, 0 for validation by data.val_fraction); give the silo more rows or "
        "lower those fractions"
    )
