"""Store URIs whose password holds an unescaped '/', '#', '?' or '@': SQLAlchemy takes such a
password whole (postgresql://admin:Tr0ub4dor/3xyz@db/mlflow has the password 'Tr0ub4dor/3xyz'),
so what is logged of the URI (MLflow params, federation.json) and every message masks up to the
URI's last '@'. An http(s) URI whose port urllib cannot read (a '/' in its password ends the
authority early, so 'Tr0ub4dor' becomes the "port") is a one-line error at load naming the key,
not http.client's generic `InvalidURL: nonnumeric port: 'Tr0ub4dor'`."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy.engine import make_url

from silo_pfl.cli import main
from silo_pfl.config import to_dict
from silo_pfl.config_views import logged_view
from silo_pfl.errors import ConfigError, scrub
from silo_pfl.settings import load_config
from silo_pfl.tracking.store import check_store
from silo_pfl.tracking.tracker import flatten
from silo_pfl.tracking.trained_run import federation_record
from silo_pfl.tracking.uri import redact

ROOT = Path(__file__).resolve().parents[1]
JOB = str(ROOT / "jobs" / "heart_disease.yaml")  # silos cleveland, hungarian, switzerland, va
SECRET = "Tr0ub4dor"
HTTP_URI = f"http://admin:{SECRET}/3xyz@mlflow.internal:5000"
PASSWORDS = [f"{SECRET}/3xyz", f"{SECRET}#3xyz", f"{SECRET}?3xyz", f"{SECRET}/3?x#y"]


@pytest.mark.parametrize("password", PASSWORDS)
def test_a_password_sqlalchemy_takes_whole_is_masked_in_params_and_federation_json(password):
    central = f"postgresql://admin:{password}@db.example/mlflow"
    own = f"mysql+pymysql://admin:{password}@db.va/mlflow?sslmode=require&token={SECRET}"
    assert make_url(central).password == password  # a working store's password, as written
    assert make_url(own).password == password
    config = to_dict(
        load_config(
            JOB,
            [f"tracking.uri={central}", f"silos.va.tracking_uri={own}", "tracking.enabled=true"],
        )
    )
    assert config["tracking"]["uri"] == central  # the store itself is used as given
    view = logged_view(config)
    params = flatten(view)
    record = federation_record(view, (13,), 2, "")
    assert SECRET not in str(params) and SECRET not in record
    assert params["tracking.uri"] == "postgresql://admin:***@db.example/mlflow"
    assert params["silos.va.tracking_uri"] == (
        "mysql+pymysql://admin:***@db.va/mlflow?sslmode=require&token=***"
    )


@pytest.mark.parametrize(
    ("uri", "shown"),
    [
        (HTTP_URI, "http://admin:***@mlflow.internal:5000"),
        ("postgresql://admin:Tr0ub4dor/3xyz@db/mlflow", "postgresql://admin:***@db/mlflow"),
        ("postgresql://u:Tr0ub4dor@3/x@db/m", "postgresql://u:***@db/m"),  # up to the last @
        ("mssql://u@corp:Tr0ub4dor?3@db/m", "mssql://u@corp:***@db/m"),  # an @ in the user name
        ("http://u:@h:5000", "http://u:***@h:5000"),
        ("http://h:5000/api/x", "http://h:5000/api/x"),  # no password: as it was
        ("http://h/p:x@y", "http://h/p:x@y"),  # a ':' after the path is no password's
        ("sqlite:////tmp/m.db?mode=ro", "sqlite:////tmp/m.db?mode=ro"),
    ],
)
def test_redact_and_scrub_mask_up_to_the_last_at(uri, shown):
    assert redact(uri) == shown
    assert scrub(f"silo va: silos.va.tracking_uri {uri} failed") == (
        f"silo va: silos.va.tracking_uri {shown} failed"
    )


def _one_line_exit_2(capsys, argv: list[str]) -> str:
    code = main(argv)
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in captured.err, captured.err
    assert SECRET not in captured.out + captured.err
    return lines[0]


def test_config_refuses_a_silos_http_uri_whose_password_ends_the_authority(capsys):
    line = _one_line_exit_2(capsys, ["config", JOB, f"silos.va.tracking_uri={HTTP_URI}"])
    assert line.startswith(
        "error: silos.va.tracking_uri: got 'http://admin:***@mlflow.internal:5000' "
        "(password masked), expected http://host:PORT with a numeric PORT"
    ), line
    assert "%2F" in line  # how to write the password


@pytest.mark.parametrize(
    ("override", "shown"),
    [
        (f"tracking.uri={HTTP_URI}", "'http://admin:***@mlflow.internal:5000' (password masked)"),
        ("tracking.uri=http://127.0.0.1:abc", "'http://127.0.0.1:abc'"),
        ("tracking.uri=https://127.0.0.1:99999", "'https://127.0.0.1:99999'"),
    ],
)
def test_run_refuses_an_http_store_whose_port_is_no_number_naming_the_key(
    tmp_path, capsys, override, shown
):
    runs = tmp_path / "runs"
    argv = ["run", JOB, "rounds=2", "tracking.enabled=true", f"output_dir={runs}", override]
    line = _one_line_exit_2(capsys, argv)
    assert line.startswith(f"error: tracking.uri: got {shown}, expected http"), line
    assert "with a numeric PORT" in line and not runs.exists()


@pytest.mark.parametrize("command", [["models"], ["report", "0123abcd"]])
@pytest.mark.parametrize("uri", [HTTP_URI, "http://127.0.0.1:abc"])
def test_models_and_report_refuse_such_a_tracking_uri_naming_the_option(
    tmp_path, capsys, command, uri
):
    argv = [*command, "--tracking-uri", uri]
    if command[0] == "report":
        argv += ["--out", str(tmp_path / "report"), "--no-log"]
    line = _one_line_exit_2(capsys, argv)
    assert line.startswith(f"error: --tracking-uri: got '{redact(uri)}'"), line
    assert "InvalidURL" not in line and "--debug" not in line


@pytest.mark.parametrize(
    "uri",
    [HTTP_URI, "http://127.0.0.1:abc", f"https://admin:{SECRET}?x@127.0.0.1:5000"],
)
def test_the_server_check_names_the_key_and_hides_the_password(uri):
    """check_store on its own, as a node checks a store it was handed: a one-line ConfigError,
    never http.client's InvalidURL quoting part of the password."""
    with pytest.raises(ConfigError) as info:
        check_store(uri, "silos.va.tracking_uri")
    message = str(info.value)
    assert message.startswith(f"silos.va.tracking_uri: got '{redact(uri)}'"), message
    assert "\n" not in message and SECRET not in message
