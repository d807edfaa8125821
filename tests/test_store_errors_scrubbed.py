"""A store's failure never prints, logs or ships its password. MLflow's own message for a call
that fails names the URL it called, user:password@ included ("API request to
http://alice:PW@host/api/2.0/... failed with exception ..."), wherever the failing call is.

The store here is a real HTTP server on loopback that answers /health, as a store behind a
proxy does while MLflow behind it is down, and drops every API call; or, for a store lost
between two calls, answers the first one (the search that opens a client) and drops the rest."""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from silo_pfl.errors import FederationError, one_line, scrub, typed_line

PASSWORD = "pa:ss@w0rd-in-the-uri"


SEARCH = "/api/2.0/mlflow/experiments/search"


class _HealthOnly(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        answers = {"/health": b"OK", **({SEARCH: b"{}"} if self.server.opens else {})}
        if self.path.split("?")[0] in answers:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(answers[self.path.split("?")[0]])
        else:
            self.close_connection = True  # no answer: the client sees the connection dropped

    do_POST = do_GET

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(params=[False], ids=["api_down"])
def half_store(request, monkeypatch) -> Iterator[str]:
    """The URI, with a password holding ':' and '@' as some do, of a store whose API is down
    (or, with the param True, answers the search that opens a client, then goes down)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _HealthOnly)
    server.opens = request.param
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    try:
        yield f"http://alice:{PASSWORD}@127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_mlflows_own_error_holds_the_password_and_its_one_line_does_not(half_store):
    from mlflow import MlflowClient

    with pytest.raises(Exception) as info:
        MlflowClient(tracking_uri=half_store).set_tag("0" * 32, "k", "v")
    assert PASSWORD in str(info.value)  # what there is to scrub
    for line in (one_line(info.value), typed_line(info.value)):
        assert PASSWORD not in line and "w0rd" not in line
        assert "http://alice:***@127.0.0.1:" in line


def test_a_silo_whose_store_is_down_fails_without_its_password(half_store, tmp_path):
    """What the silo's process raises is what Ray ships to the driver: one line, no password,
    and no chained MLflow error in its traceback."""
    from serving import registered_silo

    with pytest.raises(FederationError) as info:
        registered_silo(tmp_path, half_store, "hungarian")
    text = str(info.value)
    assert text.startswith("tracking.uri: cannot open the MLflow store http://alice:***@127.0.0.1:")
    assert PASSWORD not in text and "w0rd" not in text
    assert info.value.__suppress_context__


@pytest.mark.parametrize("half_store", [True], ids=["lost_after_opening"], indirect=True)
def test_a_silo_whose_store_is_lost_after_opening_fails_without_its_password(half_store, tmp_path):
    from serving import registered_silo

    with pytest.raises(FederationError) as info:
        registered_silo(tmp_path, half_store, "hungarian")
    text = str(info.value)
    assert text.startswith("silo hungarian: tracking.uri http://alice:***@127.0.0.1:"), text
    assert "checking its store failed (MlflowException: API request to http://alice:***@" in text
    assert PASSWORD not in text and "w0rd" not in text
    assert info.value.__suppress_context__


def test_the_cli_names_the_store_in_one_line_without_its_password(half_store):
    done = subprocess.run(
        [sys.executable, "-m", "silo_pfl", "models", "--tracking-uri", half_store],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"},
    )
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --tracking-uri"), done.stderr
    assert "alice:***@127.0.0.1:" in lines[0]
    assert PASSWORD not in done.stdout + done.stderr and "w0rd" not in done.stderr


@pytest.mark.parametrize(
    ("text", "scrubbed"),
    [
        (
            "API request to http://u:p@ss:w@h:5000/api/2.0/x failed",
            "API request to http://u:***@h:5000/api/2.0/x failed",
        ),
        (
            "see https://h/p?api_key=K&page=2 and mail a@b.c",
            "see https://h/p?api_key=***&page=2 and mail a@b.c",
        ),
        (
            "postgresql://u:pw@db/m, then http://h:5000/health",
            "postgresql://u:***@db/m, then http://h:5000/health",
        ),
    ],
)
def test_scrub_masks_url_passwords_and_secret_query_values_only(text, scrubbed):
    assert scrub(text) == scrubbed
