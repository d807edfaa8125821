"""Bad command-line input (paths, names, numbers, usage) is one line on stderr naming the option,
exit 2, checked before anything runs, and leaves nothing behind. No test here starts Ray: each
guards the step that would (the run, the comparison's pool, the Jobs client)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from silo_pfl.cli import _parse, main
from silo_pfl.config import NAME_RULE

ROOT = Path(__file__).resolve().parents[1]
HEART = str(ROOT / "jobs" / "heart_disease.yaml")
SILO_PFL = Path(sys.executable).with_name("silo-pfl")


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    """`silo-pfl ARGV` in this process: its exit code, stdout and stderr."""
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_line(code: int, err: str, expected: str) -> None:
    """Exit 2 and stderr exactly the line `expected`, without a traceback."""
    assert code == 2, err
    assert err == expected + "\n", err


def refuse(*_: object, **__: object) -> None:
    """Stands in for whatever a command must not reach with bad input."""
    raise AssertionError("the command went past its input checks")


@pytest.fixture
def no_run(monkeypatch):
    """A run, an onboarding or a submission that got past its checks fails the test at once."""
    from silo_pfl.federation import Federation
    from silo_pfl.runtime import jobs, session

    monkeypatch.setattr(session, "ray_session_while", refuse)
    monkeypatch.setattr(Federation, "onboard", refuse)
    monkeypatch.setattr(jobs, "JobsClient", refuse)


def results_command(command: str, tmp_path: Path, results: str) -> list[str]:
    """`COMMAND heart_disease.yaml ... --results RESULTS` (run, onboard or submit)."""
    where = [f"output_dir={tmp_path / 'runs'}", "tracking.enabled=false"]
    silo = ["--silo", "cleveland"] if command == "onboard" else []
    return [command, HEART, "rounds=2", *where, *silo, "--quiet", "--results", results]


@pytest.mark.usefixtures("no_run")
@pytest.mark.parametrize("command", ["run", "onboard", "submit"])
def test_results_that_is_a_directory_is_refused_before_anything_runs(command, tmp_path, capsys):
    resdir = tmp_path / "resdir"
    resdir.mkdir()
    code, _, err = cli(capsys, *results_command(command, tmp_path, str(resdir)))
    assert_one_line(code, err, f"error: --results {resdir}: is a directory, expected a file path")
    assert list(resdir.iterdir()) == [] and not (tmp_path / "runs").exists()


@pytest.mark.usefixtures("no_run")
def test_results_that_names_a_directory_or_cannot_be_written_is_refused(tmp_path, capsys):
    """`newdir/` named a directory that is not there: the results were written to a file
    `newdir`; /proc takes no new file even for root, for whom os.access says it does: the
    whole run went through, then its results were lost."""
    new = f"{tmp_path / 'newdir'}/"
    code, _, err = cli(capsys, *results_command("run", tmp_path, new))
    assert_one_line(code, err, f"error: --results {new}: is a directory, expected a file path")
    assert not (tmp_path / "newdir").exists()
    code, _, err = cli(capsys, *results_command("run", tmp_path, "/proc/x.json"))
    assert code == 2 and err.startswith("error: --results /proc/x.json: cannot write in directory")
    assert err.count("\n") == 1


@pytest.mark.usefixtures("no_run")
@pytest.mark.parametrize("command", ["run", "onboard", "submit"])
def test_an_empty_results_path_is_refused(command, tmp_path, capsys):
    code, _, err = cli(capsys, *results_command(command, tmp_path, ""))
    assert_one_line(code, err, "error: --results: got '', expected a file path")


@pytest.mark.parametrize("action", ["init", "show"])
def test_a_key_dir_that_is_a_file_is_refused(action, tmp_path, capsys):
    file = tmp_path / "f"
    file.write_text("not a directory")
    where = ["--federation", "fed", "--silo", "va"]
    code, _, err = cli(capsys, "keys", action, *where, "--key-dir", str(file))
    assert_one_line(code, err, f"error: --key-dir {file}: is a file, expected a directory")
    code, _, err = cli(capsys, "keys", action, *where, "--key-dir", str(file / "va"))
    assert_one_line(
        code, err, f"error: --key-dir {file / 'va'}: {file} is a file, expected a directory"
    )
    assert file.read_text() == "not a directory"


@pytest.mark.parametrize(
    ("federation", "silo", "key", "bad"),
    [
        ("", "", "--federation", ""),
        ("fed", "", "--silo", ""),
        ("../../../esc", "s", "--federation", "../../../esc"),
        ("fed", "..", "--silo", ".."),
        ("a/b", "s", "--federation", "a/b"),
        ("fed", "a\\b", "--silo", "a\\b"),
        ("fed", "a..b", "--silo", "a..b"),
    ],
)
def test_keys_refuse_names_that_are_not_one_directory(
    federation, silo, key, bad, tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for action in ("init", "show"):
        code, out, err = cli(capsys, "keys", action, "--federation", federation, "--silo", silo)
        assert_one_line(code, err, f"error: {key}: got {bad!r}, expected {NAME_RULE}")
        assert out == ""
    assert list(tmp_path.iterdir()) == []  # ~ untouched, nothing written outside it either


def test_keys_accept_the_names_jobs_use(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    code, out, _ = cli(capsys, "keys", "init", "--federation", "heart_disease", "--silo", "va")
    assert code == 0 and out.splitlines()[1].startswith("silos.va.identity_key=")
    assert (tmp_path / ".silo_pfl" / "keys" / "heart_disease" / "va" / "identity.key").is_file()


@pytest.fixture
def tracked_run(mlflow_store, tmp_path, monkeypatch) -> str:
    """A store holding one federation's parent run with a silo's child run (no rounds); the
    working directory is tmp_path."""
    from mlflow import MlflowClient

    from silo_pfl.tracking import registry
    from silo_pfl.tracking.tracker import PARENT_RUN_TAG

    monkeypatch.chdir(tmp_path)
    client = MlflowClient(mlflow_store)
    experiment = client.create_experiment("fed", (tmp_path / "artifacts").as_uri())
    parent = client.create_run(experiment, tags={registry.FEDERATION: "fed"}).info.run_id
    client.create_run(experiment, tags={PARENT_RUN_TAG: parent, registry.SILO: "va"})
    return parent


@pytest.mark.parametrize("bad", ["run", "against"])
def test_a_report_on_bad_runs_leaves_no_directory(bad, tracked_run, tmp_path, capsys):
    unknown = "0123456789abcdef"
    run_id, against = (unknown, tracked_run) if bad == "run" else (tracked_run, unknown)
    key = "RUN_ID" if bad == "run" else "--against"
    kept = tmp_path / "kept"
    kept.mkdir()
    for out in (["--out", "reports/r01"], [], ["--out", str(kept)]):
        code, _, err = cli(capsys, "report", run_id, "--against", against, "--no-log", *out)
        assert code == 2 and err.startswith(f"error: {key} {unknown}: no such run"), err
        assert err.count("\n") == 1, err
        assert not (tmp_path / "reports").exists()
    assert list(kept.iterdir()) == []


@pytest.fixture
def spec(tmp_path, monkeypatch) -> Path:
    """A two-algorithm spec on heart disease; a comparison that would start its pool fails."""
    import silo_pfl.compare

    monkeypatch.setattr(silo_pfl.compare.cf, "ProcessPoolExecutor", refuse)
    path = tmp_path / "spec.yaml"
    path.write_text(
        f"baseline: local\njobs:\n  heart:\n    config: {HEART}\n    seeds: [0]\n"
        "    overrides: [rounds=2]\nalgorithms:\n  local: {}\n  fedavg: {}\n"
    )
    return path


def test_compare_outputs_that_are_directories_are_refused_before_anything_runs(
    spec, tmp_path, capsys
):
    outdir = tmp_path / "outdir"
    outdir.mkdir()
    files = ["--cache", str(tmp_path / "cache"), "--workers", "1"]
    for option, other in (("--out", "--json"), ("--json", "--out")):
        paths = [option, str(outdir), other, str(tmp_path / "o")]
        code, _, err = cli(capsys, "compare", str(spec), *files, *paths)
        assert_one_line(
            code, err, f"error: {option} {outdir}: is a directory, expected a file path"
        )
        code, _, err = cli(capsys, "compare", str(spec), *files, *paths[2:], option, "")
        assert_one_line(code, err, f"error: {option}: got '', expected a file path")
    assert list(outdir.iterdir()) == [] and not (tmp_path / "cache").exists()


@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]])
def test_a_compare_cache_that_is_a_file_is_refused_before_anything_runs(
    dry_run, spec, tmp_path, capsys
):
    file = tmp_path / "f"
    file.write_text("not a directory")
    outputs = ["--out", str(tmp_path / "o.md"), "--json", str(tmp_path / "o.json"), *dry_run]
    code, _, err = cli(capsys, "compare", str(spec), "--cache", str(file), *outputs)
    assert_one_line(code, err, f"error: --cache {file}: is a file, expected a directory")
    code, _, err = cli(capsys, "compare", str(spec), "--cache", str(file / "c"), *outputs)
    assert_one_line(
        code, err, f"error: --cache {file / 'c'}: {file} is a file, expected a directory"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f", "spec.yaml"]


@pytest.mark.parametrize("limit", ["-5", "0"])
def test_jobs_limit_below_one_is_refused_before_any_cluster_is_contacted(
    limit, capsys, monkeypatch
):
    from silo_pfl.runtime import jobs

    monkeypatch.setattr(jobs, "JobsClient", refuse)
    code, out, err = cli(capsys, "jobs", "--limit", limit, "--address", "http://127.0.0.1:9")
    assert_one_line(code, err, f"error: --limit: got {limit}, expected an integer >= 1")
    assert out == ""


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([], "silo-pfl: the following arguments are required: command (see silo-pfl --help)"),
        (
            ["run"],
            "silo-pfl run: the following arguments are required: config (see silo-pfl run --help)",
        ),
        (
            ["run", "x.yaml", "--bogus"],
            "silo-pfl run: unrecognized arguments: --bogus (see silo-pfl run --help)",
        ),
        (
            ["jobs", "--limit", "abc"],
            "silo-pfl jobs: argument --limit: invalid int value: 'abc' (see silo-pfl jobs --help)",
        ),
        (
            ["jobs", "rounds=2"],
            "silo-pfl jobs: unrecognized arguments: rounds=2 (see silo-pfl jobs --help)",
        ),
        (
            ["onboard", HEART],
            "silo-pfl onboard: the following arguments are required: --silo "
            "(see silo-pfl onboard --help)",
        ),
    ],
)
def test_usage_errors_are_one_line_and_help_is_whole(argv, expected, capsys):
    code, out, err = cli(capsys, *argv)
    assert_one_line(code, err, f"error: {expected}")
    assert out == ""
    code, out, err = cli(capsys, *argv[:1], "--help")
    assert code == 0 and err == "" and "--debug" in out
    assert out.startswith(f"usage: silo-pfl {' '.join(argv[:1])}".rstrip())


def test_run_help_prints_the_whole_usage(capsys):
    code, out, _ = cli(capsys, "run", "--help")
    assert code == 0 and out.startswith("usage: silo-pfl run [-h] [--results RESULTS]")
    assert all(word in out for word in ("config", "overrides", "--quiet", "--resume", "--debug"))


def test_overrides_stay_optional_and_may_follow_the_options():
    assert _parse(["run", HEART]).overrides == []
    args = _parse(["run", HEART, "--quiet", "rounds=2", "--results", "r.json", "seed=1"])
    assert args.overrides == ["rounds=2", "seed=1"] and args.results == "r.json"
    assert _parse(["config", HEART]).overrides == []


@pytest.mark.parametrize("command", ["run", "submit"])
def test_resume_right_before_the_job_resumes_the_jobs_latest_run(command):
    """`run --resume jobs/x.yaml` took the job's path for a run id, then missed the job."""
    args = _parse([command, "--resume", HEART, "rounds=40", "--quiet"])
    assert (args.config, args.resume, args.overrides, args.quiet) == (
        HEART,
        True,
        ["rounds=40"],
        True,
    )
    args = _parse([command, HEART, "--resume", "20261206-151550-10f40f"])
    assert (args.config, args.resume) == (HEART, "20261206-151550-10f40f")


@pytest.mark.parametrize("buffered", [False, True], ids=["unbuffered", "buffered"])
def test_a_reader_that_has_gone_ends_the_command_quietly(buffered):
    """`silo-pfl config JOB | head -1`: once head has its line and exits, the CLI's next write
    finds the pipe closed. The read end is closed here before the CLI writes, which makes that
    race certain. Unbuffered (PYTHONUNBUFFERED), `print` fails inside the command; buffered, the
    interpreter's flush at exit does. Either way: no error, no traceback, exit 141 (SIGPIPE's)."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONUNBUFFERED"}
    if not buffered:
        env["PYTHONUNBUFFERED"] = "1"
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run(
            [str(SILO_PFL), "config", HEART],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=ROOT,
            timeout=300,
        )
    finally:
        os.close(write)
    assert "error" not in done.stderr.lower() and "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 141, done.stderr


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["run", HEART, "tracking.uri="],
            "error: tracking.uri: got an empty value ('tracking.uri=', an unset shell "
            "variable?); give a value, or tracking.uri=null for none",
        ),
        (
            ["config", HEART, "rounds="],
            "error: rounds: got an empty value ('rounds=', an unset shell variable?); give a value",
        ),
        (
            ["config", HEART, "silos.va.tracking_uri="],
            "error: silos.va.tracking_uri: got an empty value ('silos.va.tracking_uri=', an unset "
            "shell variable?); give a value, or silos.va.tracking_uri=null for none",
        ),
        (
            ["config", HEART, "data.label_column="],
            "error: data.label_column: got an empty value ('data.label_column=', an unset shell "
            "variable?); give a value",
        ),
        (
            ["config", HEART, "output_dir="],
            "error: output_dir: got an empty value ('output_dir=', an unset shell variable?); "
            "give a value",
        ),
        (
            ["run", HEART, "tracking.uri=''"],
            "error: tracking.uri: got '', expected a value, or null for the default",
        ),
        (
            ["submit", HEART, "ray.address=' '", "--address", "http://127.0.0.1:9"],
            "error: ray.address: got ' ', expected a value, or null for the default",
        ),
        (
            ["config", HEART, "silos.va.key_dir=''"],
            "error: silos.va.key_dir: got '', expected a value, or null for the default",
        ),
        (
            ["config", HEART, "aggregation.secure=true", "aggregation.identity_keys=''"],
            "error: aggregation.identity_keys: got '', expected a value, or null for the default",
        ),
        (
            ["config", HEART, "aggregation.secure=true", "silos.va.identity_key=' '"],
            "error: silos.va.identity_key: got ' ', expected a value, or null for the default",
        ),
        (
            ["config", HEART, "output_dir='  '"],
            "error: output_dir: got '  ', expected a directory",
        ),
        (
            ["models", "--tracking-uri", ""],
            "error: silo-pfl models: --tracking-uri: got '', expected a value, or no "
            "--tracking-uri for the default (see silo-pfl models --help)",
        ),
        (
            ["models", "--federation", ""],
            "error: --federation: got '', expected a federation's name",
        ),
        (
            ["report", "0123", "--out", ""],
            "error: --out: got '', expected a directory, or no --out for the default",
        ),
        (
            ["onboard", HEART, "--silo", " "],
            "error: --silo: got ' ', expected the joining silo's name",
        ),
    ],
)
def test_an_empty_value_is_refused_rather_than_read_as_the_default(
    argv, expected, tmp_path, capsys, monkeypatch
):
    """An unset shell variable gives `key=` or `--option ''`: taken as "not given", it would send
    a run's models to a store in the working directory, or start a local Ray instead of joining
    the cluster, without a word."""
    monkeypatch.chdir(tmp_path)
    code, out, err = cli(capsys, *argv)
    assert_one_line(code, err, expected)
    assert out == "" and list(tmp_path.iterdir()) == []


def test_a_key_dir_of_no_users_home_or_where_nothing_can_be_written_is_one_line(capsys):
    keys = ["keys", "init", "--federation", "f", "--silo", "s", "--key-dir"]
    code, _, err = cli(capsys, *keys, "~no_such_user_here/keys")
    assert_one_line(
        code, err, "error: --key-dir: ~no_such_user_here/keys: Could not determine home directory."
    )
    code, _, err = cli(capsys, *keys, "/proc/silo_pfl_keys")
    assert code != 0 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("error: /proc/silo_pfl_keys: cannot write an identity key there ("), err


def test_a_token_file_that_cannot_be_read_is_one_line_naming_it(capsys):
    code, _, err = cli(
        capsys, "jobs", "--address", "http://127.0.0.1:1", "--token-file", "/proc/self/mem"
    )
    assert_one_line(
        code, err, "error: --token-file /proc/self/mem: cannot be read (Input/output error)"
    )


def test_a_pipe_named_as_the_identity_key_file_is_refused_without_waiting_on_it(capsys, tmp_path):
    """A pipe no one writes to would wait for ever; a process substitution is the driver's."""
    fifo = tmp_path / "keys.fifo"
    os.mkfifo(fifo)
    code, _, err = cli(
        capsys, "config", HEART, "aggregation.secure=true", f"aggregation.identity_keys={fifo}"
    )
    assert_one_line(
        code,
        err,
        f"error: aggregation.identity_keys: {fifo} is not a regular file; name a file that "
        "lists the silos' keys",
    )


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ((), "error: silo mayo: not a silo of data.source=heart_disease; its silos are "),
        (
            ("tracking.enabled=false",),
            "error: tracking.enabled: onboarding reads the trained federation from the tracking "
            "store; set tracking.enabled=true",
        ),
    ],
)
def test_a_submitted_onboarding_is_checked_as_onboard_checks_it_before_it_is_sent(
    capsys, overrides, expected
):
    """`onboard --silo mayo` is refused here; `submit --onboard mayo` was sent to the cluster."""
    code, out, err = cli(
        capsys,
        "submit",
        HEART,
        "--address",
        "http://127.0.0.1:9",
        "--no-wait",
        "--onboard",
        "mayo" if not overrides else "va",
        "tracking.uri=sqlite:////tmp/never.db",
        *overrides,
    )
    assert code == 2 and err.count("\n") == 1 and err.startswith(expected), err
    assert out == ""


def test_models_local_that_is_no_directory_is_a_usage_error(tmp_path, capsys):
    """It exited 1, as a failure of the store would, not 2 as other bad paths do."""
    missing = tmp_path / "nowhere"
    code, _, err = cli(capsys, "models", "--local", str(missing))
    assert_one_line(
        code, err, f"error: --local {missing}: not a directory; expected a run's output_dir"
    )


def test_the_closing_models_line_names_the_silos_with_stores_of_their_own(tmp_path):
    """The line named only the central store: pasted, it listed no model of a silo with a store
    of its own ("no registered silo models" when every silo had one)."""
    from silo_pfl.cli import models_hint
    from silo_pfl.settings import load_config

    hospitals = ["cleveland", "hungarian", "switzerland", "va"]
    central = "sqlite:////data/central.db"
    own = "silos.va.tracking_uri=http://mlflow:s3cret@va.example:5000"
    cfg = load_config(HEART, [f"output_dir={tmp_path}", own])
    assert models_hint(cfg, central, hospitals) == (
        f"silo-pfl models --federation heart_disease --tracking-uri {central}; va's in its own "
        "store (silo-pfl models --federation heart_disease --tracking-uri "
        "'http://mlflow:***@va.example:5000', on its node)"
    )
    every = [f"silos.{h}.tracking_uri=sqlite:///{h}.db" for h in hospitals]
    hint = models_hint(load_config(HEART, [f"output_dir={tmp_path}", *every]), central, hospitals)
    assert hint.startswith("none in the central store; cleveland's in its own store (")
    assert hint.count("in its own store") == 4


def test_models_fills_in_the_variables_of_a_store_uri_as_printed(tmp_path, monkeypatch, capsys):
    """The closing line quotes a silo's own store as configured ('$VA_MLFLOW_URI', for its node's
    shell to leave alone): `models` took the quoted name for the URI and refused it."""
    from mlflow import MlflowClient

    store = f"sqlite:///{tmp_path / 'va.db'}"
    MlflowClient(store).search_experiments()  # an MLflow store, empty
    monkeypatch.setenv("VA_MLFLOW_URI", store)
    assert main(["models", "--tracking-uri", "$VA_MLFLOW_URI"]) == 0
    monkeypatch.delenv("VA_MLFLOW_URI")
    capsys.readouterr()
    assert main(["models", "--tracking-uri", "$VA_MLFLOW_URI"]) == 2
    err = capsys.readouterr().err
    assert err == "error: --tracking-uri: environment variable VA_MLFLOW_URI is not set\n"
