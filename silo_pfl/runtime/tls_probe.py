"""A TLS handshake with a cluster's GCS before Ray's own: Ray retries a handshake that fails (a
certificate of another CA, a missing file) for minutes, logging gRPC's errors, and a client
without TLS meets a GCS that speaks it as one that closes the connection. One line instead."""

from __future__ import annotations

import os
import socket
import ssl

TLS_VARS = ("RAY_TLS_SERVER_CERT", "RAY_TLS_SERVER_KEY", "RAY_TLS_CA_CERT")
SETUP_HINT = (
    "set RAY_USE_TLS=1 and RAY_TLS_SERVER_CERT, RAY_TLS_SERVER_KEY, RAY_TLS_CA_CERT to the "
    "cluster's certificates (cluster/make_certs.sh)"
)


def speaks_tls(where: tuple[str, int], timeout: float) -> bool:
    """Whether the server at `where` answers a TLS client hello as a TLS server: it completes
    the handshake or ends it with a TLS alert (one that asks a client certificate, say). A
    plain gRPC server answers with HTTP/2 bytes, which no TLS client reads as a record."""
    context = _client_context()
    context.verify_mode = ssl.CERT_NONE
    try:
        with (
            socket.create_connection(where, timeout=timeout) as conn,
            context.wrap_socket(conn, server_hostname=where[0]),
        ):
            return True
    except ssl.SSLError as exc:
        return "ALERT" in str(exc.reason or "").upper()
    except OSError:
        return False


def tls_problem(where: tuple[str, int], timeout: float) -> str | None:
    """With RAY_USE_TLS on: what keeps this client's TLS from reaching the server at `where`, in
    a few words naming the variable at fault; None if the handshake succeeds (or cannot be
    judged: a timeout is left to Ray)."""
    paths = {name: os.environ.get(name, "") for name in TLS_VARS}
    missing = [name for name, path in paths.items() if not path]
    if missing:
        return f"RAY_USE_TLS=1 also needs {', '.join(missing)}; {SETUP_HINT}"
    ca, cert = paths["RAY_TLS_CA_CERT"], paths["RAY_TLS_SERVER_CERT"]
    key = paths["RAY_TLS_SERVER_KEY"]
    context = _client_context()
    try:
        context.load_verify_locations(cafile=ca)
    except (OSError, ssl.SSLError) as exc:
        return f"RAY_TLS_CA_CERT={ca}: not a readable CA certificate ({_reason(exc)})"
    try:
        context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        return (
            f"RAY_TLS_SERVER_CERT={cert} with RAY_TLS_SERVER_KEY={key}: not a readable "
            f"certificate and its key ({_reason(exc)})"
        )
    try:
        with (
            socket.create_connection(where, timeout=timeout) as conn,
            context.wrap_socket(conn, server_hostname=where[0]) as tls,
        ):
            tls.recv(1)  # under TLS 1.3 a refused client certificate is told after the handshake
    except ssl.SSLCertVerificationError as exc:
        return (
            f"its TLS certificate is not signed by RAY_TLS_CA_CERT={ca} ({exc.verify_message}); "
            "use the cluster's CA certificate"
        )
    except ssl.SSLError as exc:
        reason = str(exc.reason or exc)
        if "ALERT" in reason.upper():
            return (
                f"it refused this client's certificate RAY_TLS_SERVER_CERT={cert} ({reason}); "
                "use a certificate signed by the cluster's CA"
            )
        return f"it does not answer as a TLS server ({reason}), but RAY_USE_TLS=1 is set"
    except OSError:
        return None
    return None


def _client_context() -> ssl.SSLContext:
    """A TLS client's context as gRPC's: HTTP/2 by ALPN. The host name is not checked (gRPC
    checks it); only the chain of trust, unless the caller turns that off too."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.set_alpn_protocols(["h2"])
    return context


def _reason(exc: BaseException) -> str:
    return str(getattr(exc, "strerror", None) or getattr(exc, "reason", None) or exc)
