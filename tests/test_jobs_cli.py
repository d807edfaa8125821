"""`silo-pfl submit/jobs/stop` before any cluster answers: bad input is one line, exit 2."""

from __future__ import annotations

import importlib
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
from serving import free_port

from silo_pfl.errors import ConfigError
from silo_pfl.runtime.jobs import auth_token, jobs_address, output_dir_note

ROOT = Path(__file__).resolve().parents[1]
JOB = "jobs/heart_disease.yaml"


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    return subprocess.run(
        [sys.executable, "-m", "silo_pfl", *args],
        cwd=ROOT,
        env={**base, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_jobs_address_comes_from_the_flag_then_ray_s_variables(monkeypatch):
    monkeypatch.delenv("RAY_API_SERVER_ADDRESS", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ConfigError, match="--address: no Jobs API address"):
        jobs_address(None)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:8265")
    assert jobs_address(None) == "http://10.0.0.1:8265"
    monkeypatch.setenv("RAY_API_SERVER_ADDRESS", "https://head:8265")
    assert jobs_address(None) == "https://head:8265"
    assert jobs_address("http://127.0.0.1:9") == "http://127.0.0.1:9"
    with pytest.raises(ConfigError, match="expected the Jobs API"):
        jobs_address("auto")
    monkeypatch.delenv("RAY_API_SERVER_ADDRESS")
    monkeypatch.setenv("RAY_ADDRESS", "auto")  # as a driver on a cluster may have it
    with pytest.raises(ConfigError, match="^RAY_ADDRESS: got 'auto', expected the Jobs API"):
        jobs_address(None)


def test_the_token_comes_from_the_variable_then_a_file(monkeypatch, tmp_path):
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert auth_token() is None
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("from-home\n")
    assert auth_token() == "from-home"
    (tmp_path / "t").write_text("from-file")
    assert auth_token(str(tmp_path / "t")) == "from-file"
    monkeypatch.setenv("RAY_AUTH_TOKEN", "from-env")
    assert auth_token() == "from-env"
    assert auth_token(str(tmp_path / "t")) == "from-file", "a file given on purpose wins"
    monkeypatch.delenv("RAY_AUTH_TOKEN")
    with pytest.raises(ConfigError, match="--token-file .*missing: not found"):
        auth_token(str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match=f"^--token-file {tmp_path}: not a file$"):
        auth_token(str(tmp_path))
    (tmp_path / "binary").write_bytes(b"\xbd\xff\x00token")
    with pytest.raises(ConfigError, match=r"binary: not a UTF-8 text file \(a token is one"):
        auth_token(str(tmp_path / "binary"))


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ((JOB, "rounds=0", "--address", "http://127.0.0.1:9"), "error: rounds: got 0"),
        ((JOB, "tracking.enabled=false"), "error: --address: no Jobs API address"),
        ((JOB, "--address", "http://127.0.0.1:9"), "error: tracking.uri: a federation submitted"),
        (
            (JOB, "tracking.enabled=false", "--no-wait", "--results", "r.json", "--address", "x:1"),
            "error: --results: needs",
        ),
        (
            (JOB, "tracking.enabled=false", "--resume", "--address", "http://127.0.0.1:9"),
            "error: output_dir: got 'runs', a relative path, which each node resolves against the "
            "directory its Ray was started in, so a resume cannot count on finding the run; give "
            "an absolute path",
        ),
    ],
)
def test_a_bad_submission_exits_2_in_one_line_before_anything_is_sent(args, expected):
    done = _cli("submit", *args)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [done.stderr.strip()]
    assert done.stderr.startswith(expected)


@pytest.mark.parametrize(
    "command",
    [("jobs",), ("stop", "some-job"), ("submit", JOB, "tracking.uri=http://127.0.0.1:9")],
)
def test_an_unreachable_cluster_is_one_line_naming_the_address(command):
    address = f"http://127.0.0.1:{free_port()}"
    done = _cli(*command, "--address", address, env={"RAY_AUTH_TOKEN": "t"})
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: --address {address}: "), last


@pytest.mark.parametrize("variable", ["RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"])
def test_the_address_given_is_the_only_one_dialled(variable):
    """Ray's Jobs client takes these variables over the address it is given: a stale one (here
    a GCS address nothing listens on) made `silo-pfl jobs --address A` dial it for 40 s, print
    Ray's warnings, and blame A."""
    address = f"http://127.0.0.1:{free_port()}"
    env = {"RAY_AUTH_TOKEN": "t", variable: f"127.0.0.1:{free_port()}"}
    began = time.monotonic()
    done = _cli("jobs", "--address", address, env=env)
    assert time.monotonic() - began < 15
    assert done.returncode == 1, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"error: --address {address}: Failed to connect to Ray at address"), line


def test_overrides_may_follow_the_options():
    from silo_pfl.cli import _parse

    args = _parse(["submit", JOB, "rounds=2", "--address", "http://h:8265", "seed=3", "--no-wait"])
    assert args.overrides == ["rounds=2", "seed=3"] and args.address == "http://h:8265"
    args = _parse(["run", JOB, "--quiet", "rounds=2", "--results", "r.json"])
    assert args.overrides == ["rounds=2"] and args.quiet and args.results == "r.json"
    with pytest.raises(SystemExit):
        _parse(["jobs", "rounds=2"])
    args = _parse(["submit", JOB, "--resume", "rounds=9", "--address", "http://h:8265"])
    assert args.resume is True and args.overrides == ["rounds=9"]
    args = _parse(["submit", JOB, "--resume", "20261130-052301-3fa9c2", "--address", "a:1"])
    assert args.resume == "20261130-052301-3fa9c2"


def test_a_fresh_submission_with_a_relative_output_dir_is_warned_of():
    """Its run lies wherever each node's Ray was started: a later job may not find it."""
    assert output_dir_note("/var/tmp/silo_pfl", False) is None
    assert output_dir_note("~/runs", False) is None
    assert output_dir_note("runs", False) == (
        "output_dir: got 'runs', a relative path, which each node resolves against the "
        "directory its Ray was started in; to know where the run lies and resume it later, give "
        "an absolute path that every node can write, e.g. output_dir=/var/tmp/silo_pfl"
    )


@pytest.mark.parametrize(
    ("message", "reason"),
    [
        (
            "Job entrypoint command failed with exit code 1, last available logs (truncated to "
            "20,000 chars):\nround  1/5 ...\nerror: silo va: no live Ray node carries the label "
            "silo=va\n",
            "silo va: no live Ray node carries the label silo=va (Job entrypoint command failed "
            "with exit code 1)",
        ),
        (
            "Job entrypoint command failed with exit code 137, last available logs (truncated to "
            "20,000 chars):\nround 11/20    0.42s  elapsed 0:10\nKilled\n",
            "Job entrypoint command failed with exit code 137 (the driver was killed by signal 9)",
        ),
        (  # where /bin/sh is bash, it execs the entrypoint: the signal's own negative code
            "Job entrypoint command failed with exit code -9, last available logs (truncated to "
            "20,000 chars):\nround 11/20    0.42s  elapsed 0:10\n",
            "Job entrypoint command failed with exit code -9 (the driver was killed by signal 9)",
        ),
        ("Job finished successfully.", "Job finished successfully."),
        ("", ""),
    ],
    ids=["driver-error", "killed", "killed-exec", "plain", "none"],
)
def test_a_jobs_reason_is_the_drivers_error_and_rays_exit_code_not_its_last_log_line(
    message, reason
):
    """Ray quotes the driver's last logs after its first line: the reason was the last of them,
    a progress line or the shell's 'Killed'."""
    from silo_pfl.runtime.jobs import job_reason

    assert job_reason(message) == reason


def test_an_address_that_is_no_ray_dashboard_says_so(tmp_path):
    """An HTTP server that is not Ray's (MLflow's, say: both addresses are printed together)
    answers 404 to Ray's version check; the line says what the address is not, not Ray's
    'ensure the cluster is running Ray 1.9 or higher'."""
    import functools
    import http.server
    import threading

    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    address = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        done = _cli("jobs", "--address", address, env={"RAY_AUTH_TOKEN": "t"})
    finally:
        server.shutdown()
    assert done.returncode == 1 and done.stderr == (
        f"error: --address {address}: it is not a Ray dashboard's Jobs API (no /api/version "
        "there); give the dashboard's address, e.g. http://HOST:8265\n"
    ), done.stderr


def test_onboarding_options_without_an_onboarding_are_refused_before_submitting(capsys):
    from silo_pfl.cli import main

    for wrong, message in (
        (["--from", "x"], "error: --from: an onboarding's option; give --onboard SILO too\n"),
        (["--no-alone"], "error: --no-alone: an onboarding's option; give --onboard SILO too\n"),
        (
            ["--onboard", "va", "--resume"],
            "error: --resume: an onboarding cannot be resumed; drop --resume or --onboard\n",
        ),
    ):
        assert main(["submit", JOB, *wrong, "--address", "http://127.0.0.1:9"]) == 2
        assert capsys.readouterr().err == message


class _FakeJobs:
    """Ray's JobSubmissionClient, as far as `submit` uses it: records each submission."""

    def __init__(self) -> None:
        self.submitted: list[dict] = []

    def submit_job(self, **job: object) -> str:
        self.submitted.append(job)
        return str(job["submission_id"])


@pytest.mark.parametrize("named_in", ["override", "yaml"])
def test_a_submitted_identity_keys_file_travels_as_its_keys(tmp_path, monkeypatch, named_in):
    """The file is on the submitter's machine: the job, which loads its config elsewhere, gets
    the keys it lists as silos.<S>.identity_key overrides, and never the file's name."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from silo_pfl.cli import main
    from silo_pfl.runtime.jobs import JobsClient, config_file
    from silo_pfl.secure import identity
    from silo_pfl.settings import load_config

    hospitals = ("cleveland", "hungarian", "switzerland", "va")
    raw = {h: identity.public_bytes(Ed25519PrivateKey.generate()) for h in hospitals}
    submitter, elsewhere = tmp_path / "submitter", tmp_path / "driver"
    submitter.mkdir()
    elsewhere.mkdir()
    (submitter / "keys.txt").write_text(
        "".join(f"{h} {identity.encode_public(key)}\n" for h, key in raw.items())
    )
    config = submitter / "job.yaml"
    secure = ["aggregation.secure=true", "aggregation.identity_keys=keys.txt"]
    text = (ROOT / JOB).read_text()
    if named_in == "yaml":
        text += "aggregation:\n  secure: true\n  identity_keys: keys.txt\n"
        secure = []
    config.write_text(text)
    fake = _FakeJobs()
    monkeypatch.setattr(JobsClient, "client", property(lambda _self: fake))
    monkeypatch.setenv("RAY_AUTH_TOKEN", "t")
    monkeypatch.chdir(submitter)
    options = ["tracking.enabled=false", "output_dir=/var/tmp/silo_pfl", "--no-wait"]
    assert main(["submit", "job.yaml", *secure, *options, "--address", "http://h:8265"]) == 0

    (job,) = fake.submitted
    assert "keys.txt" not in str(job["entrypoint"])
    argv = shlex.split(str(job["entrypoint"]))
    overrides = argv[5 : argv.index("--results-in-log")]
    monkeypatch.chdir(elsewhere)
    with config_file(argv[4]) as path:
        cfg = load_config(path, overrides)
    assert identity.configured_keys(cfg, list(hospitals)) == raw


def test_a_namespace_package_plugin_is_shipped(tmp_path, monkeypatch):
    """A plugin package without __init__.py (a namespace package, whose spec has no origin) is
    shipped as its one directory, as a regular package is."""
    from silo_pfl.runtime.jobs import plugin_code

    package = tmp_path / "nsplug"
    package.mkdir()
    (package / "algo.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert plugin_code(["nsplug.algo"]) == [str(package)]
    second = tmp_path / "more" / "nsplug"
    second.mkdir(parents=True)
    monkeypatch.syspath_prepend(str(tmp_path / "more"))
    importlib.invalidate_caches()
    with pytest.raises(ConfigError, match="^plugins: nsplug.algo: namespace package nsplug spans"):
        plugin_code(["nsplug.algo"])


def test_a_submission_whose_silo_reads_a_node_variable_unpinned_is_refused_before_it_goes(
    monkeypatch, capsys
):
    """A submitted job always runs on a cluster, though the submitting machine joins none: a
    silo whose file names a node's $VARS, left to any node, is refused here, nothing sent."""
    from silo_pfl.cli import main
    from silo_pfl.runtime.jobs import JobsClient

    fake = _FakeJobs()
    monkeypatch.setattr(JobsClient, "client", property(lambda _self: fake))
    monkeypatch.setenv("RAY_AUTH_TOKEN", "t")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    job = "jobs/hospitals_on_nodes.yaml"
    options = ["tracking.enabled=false", "output_dir=/var/tmp/silo_pfl", "--no-wait"]
    code = main(["submit", job, "ray.placement=any", *options, "--address", "http://h:8265"])
    err = capsys.readouterr().err
    assert code == 2 and fake.submitted == [], err
    assert err.startswith("error: data.paths.cleveland: $SILO_PFL_DATA_DIR/heart.csv names an ")
    assert err.count("\n") == 1
