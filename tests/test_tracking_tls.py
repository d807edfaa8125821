"""An HTTPS tracking store whose certificate a private CA signed: trusted as MLflow's client
trusts it (MLFLOW_TRACKING_SERVER_CERT_PATH, MLFLOW_TRACKING_INSECURE_TLS), and an untrusted one
named as such, in one line. The server is a real TLS server on loopback, its certificates made
by cluster/make_certs.sh."""

from __future__ import annotations

import http.server
import shutil
import ssl
import subprocess
import threading
from pathlib import Path

import pytest

from silo_pfl.errors import FederationError
from silo_pfl.tracking.store import check_store

CLUSTER = Path(__file__).resolve().parents[1] / "cluster"
pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed")


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
        self.wfile.write(b"OK")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def https_store(tmp_path_factory):
    """A TLS server answering /health on 127.0.0.1, and its CA's certificate."""
    out = tmp_path_factory.mktemp("tls")
    subprocess.run(
        ["bash", str(CLUSTER / "make_certs.sh"), str(out), "127.0.0.1"],
        capture_output=True,
        timeout=60,
        check=True,
    )
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(out / "node.crt", out / "node.key")
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"https://127.0.0.1:{server.server_address[1]}", out / "ca.crt"
    server.shutdown()
    server.server_close()


@pytest.fixture(autouse=True)
def no_tls_settings(monkeypatch):
    for name in (
        "MLFLOW_TRACKING_SERVER_CERT_PATH",
        "MLFLOW_TRACKING_INSECURE_TLS",
        "MLFLOW_TRACKING_CLIENT_CERT_PATH",
        "REQUESTS_CA_BUNDLE",
        "CURL_CA_BUNDLE",
    ):
        monkeypatch.delenv(name, raising=False)


def test_a_store_whose_certificate_is_not_trusted_is_named_in_one_line(https_store):
    uri, _ = https_store
    with pytest.raises(FederationError) as caught:
        check_store(uri, "tracking.uri")
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"tracking.uri: the server at {uri} does not show a certificate")
    assert message.endswith("set MLFLOW_TRACKING_SERVER_CERT_PATH to its CA's certificate")


@pytest.mark.parametrize("how", ["ca", "insecure", "insecure-1"])
def test_a_store_trusted_as_mlflows_client_trusts_it_is_accepted(https_store, monkeypatch, how):
    uri, ca = https_store
    if how == "ca":
        monkeypatch.setenv("MLFLOW_TRACKING_SERVER_CERT_PATH", str(ca))
    else:
        monkeypatch.setenv("MLFLOW_TRACKING_INSECURE_TLS", "1" if how.endswith("1") else "true")
    check_store(uri, "tracking.uri")
