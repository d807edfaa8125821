"""Connecting to Ray: a local instance started on demand, or an existing cluster."""

from __future__ import annotations

import ipaddress
import logging
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, TypeVar

import ray

from silo_pfl.config import FederationConfig, RayConfig
from silo_pfl.errors import FederationError, Interrupted, one_line
from silo_pfl.runtime.discovery import write_discovery_file
from silo_pfl.runtime.metrics import export_interval, ray_address
from silo_pfl.runtime.ray_token import ensure_local_token
from silo_pfl.runtime.tls_probe import SETUP_HINT, speaks_tls, tls_problem
from silo_pfl.stop_signals import (
    signals_held,
    sigterm_interrupts,
    sigterm_interrupts_unless_set,
)

log = logging.getLogger(__name__)


@contextmanager
def ray_session(cfg: RayConfig, metrics_interval_s: float | None = None) -> Iterator[None]:
    """Use the Ray already initialised in this process, or start/join one for the run's length.

    With no `ray.address`, a Ray Job's driver joins its cluster (Ray sets RAY_ADDRESS for it);
    anywhere else a fresh local instance is started, never a cluster left running on the machine.
    A local instance starts without Ray's dashboard proper (Ray runs a reduced dashboard
    process for its usage statistics alone). With live metrics on (`metrics_interval_s`
    given), its processes export every `metrics_interval_s` seconds (unless
    RAY_metrics_report_interval_ms says otherwise) to its metrics agent, which runs either way,
    and the run writes the Prometheus service-discovery file the dashboard would have written.
    Whichever Ray the run uses, SIGTERM raises Interrupted inside (`sigterm_interrupts`).
    A Ray a session started is its thread's: another thread's run is refused in one line (it
    would be stopped under that run), where a Ray the user initialised is shared.
    """
    with _STARTING:
        reusing = ray.is_initialized()
        if reusing and _STARTED_BY not in (None, threading.get_ident()):
            raise FederationError(
                "another federation runs in this process, on a Ray its run started and will stop; "
                "to run several at once, call ray.init() before them (they then share it), or "
                "run them one after another"
            )
        if not reusing:
            address = _start(cfg, metrics_interval_s)
    if reusing:
        if not _OPEN:  # connected by the user (a notebook's ray.init), not by an outer session
            check_connected(cfg)
        _OPEN.append(None)
        try:
            with sigterm_interrupts_unless_set():
                yield
        finally:
            _OPEN.pop()
        return
    _OPEN.append(address)
    try:
        with sigterm_interrupts():
            yield
    finally:
        _OPEN.pop()
        with signals_held(), _STARTING:  # a second Ctrl-C cannot leave Ray half stopped
            _stop(address)


def _start(cfg: RayConfig, metrics_interval_s: float | None) -> str | None:
    """Start a local Ray (None) or join the cluster at the run's address (returned), for this
    thread's session: `_STARTED_BY` marks it until `_stop`."""
    global _STARTED_BY
    address = ray_address(cfg.address)
    if address is not None:
        key = "ray.address" if cfg.address else "RAY_ADDRESS"
        if address == "auto":
            address = resolve_auto(key)
        check_reachable(address, key)
        check_token(address, key)
    try:
        if address is None:
            ensure_local_token()
            with (
                signals_held() as held,
                _export_interval(metrics_interval_s),
                quiet_token_notice(),
            ):
                try:
                    ray.init(**local_options(cfg))
                except SystemExit as exc:  # Ray's own SIGTERM handler, in force while it starts
                    if exc.code != signal.SIGTERM:
                        raise
                    held.append(signal.SIGTERM)
            if held:
                shutdown_local()
                raise Interrupted(held[0])
            if metrics_interval_s is not None:
                write_discovery_file()
        else:
            ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
    except OSError as exc:
        if SOCKET_PATH_TOO_LONG in str(exc):
            raise FederationError(_socket_dir_too_long(str(exc))) from None
        if not isinstance(exc, ConnectionError):
            raise
        raise _unreachable(exc, address) from None
    except (RuntimeError, ValueError) as exc:
        raise _unreachable(exc, address) from None
    _STARTED_BY = threading.get_ident()
    return address


def _stop(address: str | None) -> None:
    """End the Ray `_start` started or joined."""
    global _STARTED_BY
    try:
        if address is None:
            shutdown_local()
        else:
            ray.shutdown()
    finally:
        _STARTED_BY = None


# Sessions start and stop Ray one at a time; a Ray one started is that thread's alone.
_STARTING = threading.RLock()
_STARTED_BY: int | None = None  # the thread whose session started (or joined) this process's Ray
_OPEN: list[str | None] = []  # the `ray_session`s open in this process, outermost first


def check_connected(cfg: RayConfig) -> None:
    """A run in a process whose Ray the user initialised before it uses that Ray. A warning says
    so where the config asks for another: a `ray.address` (host:port) that is not the connected
    GCS's, as far as names resolve here (a warning, as one cluster has several names), and
    `ray.num_cpus`, which only a Ray the run starts takes."""
    address = cfg.address  # auto names whatever runs; a client's port is not the GCS's
    if address in (None, "auto") or address.startswith("ray://"):
        address = None
    if address is None and cfg.num_cpus is None:
        return
    connected = ray.get_runtime_context().gcs_address
    if address not in (None, connected) and _endpoints(address).isdisjoint(_endpoints(connected)):
        log.warning(
            "ray.address=%s has no effect: this process is connected to Ray at %s already "
            "(ray.init was called before the run), and the run uses it; call ray.shutdown() "
            "first to join %s",
            address,
            connected,
            address,
        )
    if cfg.num_cpus is not None:
        log.warning(
            "ray.num_cpus=%d has no effect: this process is connected to Ray at %s already "
            "(ray.init was called before the run), which keeps its own CPUs",
            cfg.num_cpus,
            connected,
        )


def _endpoints(address: str) -> set[tuple[str, str]]:
    """(IP, port) for each address `host:port` resolves to (an IP literal is not looked up), or
    its host as written where it does not resolve; this machine's own addresses (loopback and
    the IP Ray's nodes here use) count as one."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    try:
        ips = {str(ipaddress.ip_address(host))}
    except ValueError:
        try:
            ips = {str(info[4][0]) for info in socket.getaddrinfo(host, None)}
        except (OSError, UnicodeError):
            ips = {host}
    own = {"::1", ray.util.get_node_ip_address()}
    return {("this machine" if ip in own or ip.startswith("127.") else ip, port) for ip in ips}


def _unreachable(exc: Exception, address: str | None) -> FederationError:
    """Ray could not start, or reach the cluster at `address`: one line, with the token hint
    where a cluster was joined without RAY_AUTH_MODE=token."""
    where = address or "a local instance"
    hint = ""
    if address is not None and os.environ.get("RAY_AUTH_MODE") != "token":
        hint = (
            " (a cluster with token authentication needs RAY_AUTH_MODE=token, and its token "
            "in RAY_AUTH_TOKEN or ~/.ray/auth_token)"
        )
    return FederationError(
        f"ray.address: cannot start or reach Ray at {where}: {one_line(exc)}{hint}"
    )


def resolve_auto(key: str = "ray.address") -> str:
    """ "auto" as the `host:port` it stands for, so that the checks below run on it and the run
    says which cluster it joins: the one the last `ray start` of this user started (its temp
    dir's ray_current_cluster), else the one Ray GCS running on this machine. Where Ray itself
    would join any of several clusters, or none runs, a one-line FederationError naming `key`."""
    from ray._private import services

    found = services.find_bootstrap_address(None)
    origin = "the cluster the last `ray start` here started"
    if not found:
        running = sorted(services.find_gcs_addresses())
        if len(running) != 1:
            what = (
                "no running Ray cluster on this machine"
                if not running
                else f"{len(running)} Ray clusters on this machine ({', '.join(running)}) and "
                "no `ray start` of yours naming one"
            )
            raise FederationError(
                f'{key}: "auto" found {what}; give the head\'s GCS address, host:port '
                "(ray start --head --port)"
            )
        found, origin = running[0], "the one Ray cluster running here"
    print(f'{key} "auto": joining {found}, {origin}', file=sys.stderr, flush=True)
    return found


REACH_SECONDS = 10.0  # how long a cluster's address may take to accept a connection
GCS_ANSWER_SECONDS = 3.0  # how long a GCS may take to answer the HTTP/2 preface
# What an HTTP/2 client (gRPC's, Ray's GCS clients') sends first: the preface and its SETTINGS
# (an empty frame: type 0x4, no flags, stream 0). A server's first frame is its own SETTINGS.
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 0x4, 0, 0, 0, 0, 0])
HTTP2_SETTINGS = 0x4
FRAME_HEADER = 9  # bytes: length (3), type, flags, stream id (4)
CLOSED = "it closed the connection"  # what a GCS with TLS does with a plain HTTP/2 preface


def check_reachable(address: str, key: str = "ray.address", timeout: float = REACH_SECONDS) -> None:
    """A cluster's `host:port` (or `ray://host:port`) is a Ray GCS (or Ray Client server): it
    accepts a TCP connection within `timeout` and answers as a gRPC server, in HTTP/2. Ray itself
    retries an address nothing listens on, or something else listens on, for minutes. A one-line
    FederationError naming `key` otherwise: an http(s):// address too (a dashboard's, for Ray
    Jobs). "auto" comes here resolved (`resolve_auto`). With RAY_USE_TLS, the TLS handshake
    with this client's certificates is tried instead (`tls_probe.tls_problem`); without it, a GCS
    that speaks TLS is named as such."""
    scheme, _, rest = address.rpartition("://")
    if scheme.lower() in ("http", "https"):
        raise FederationError(
            f"{key}: got {address}, an HTTP address (a dashboard's, for Ray Jobs); a run joins "
            'the GCS: host:port (ray start --head --port), or "auto"'
        )
    where = _host_port(rest)
    if where is None:
        return
    try:
        conn = socket.create_connection(where, timeout=timeout)
    except OSError as exc:
        raise FederationError(
            f"{key}: nothing accepts a connection at {address} "
            f"({exc.strerror or type(exc).__name__}); expected a running cluster's head, "
            "host:port (e.g. 10.0.0.1:6379)"
        ) from None
    with conn:
        if _tls():
            problem = tls_problem(where, GCS_ANSWER_SECONDS)
            if problem is not None:
                raise FederationError(f"{key}: {address}: {problem}")
            return
        wrong = not_http2(conn, GCS_ANSWER_SECONDS)
    if wrong == CLOSED and speaks_tls(where, GCS_ANSWER_SECONDS):  # a GCS with TLS closes
        raise FederationError(
            f"{key}: {address} speaks TLS: the cluster's nodes run with RAY_USE_TLS; {SETUP_HINT}"
        )
    if wrong is not None:
        raise FederationError(
            f"{key}: {address} answers, but not as a Ray cluster's GCS ({wrong}); give the "
            'head\'s GCS address host:port (ray start --head --port), or "auto"'
        )


TOKEN_ANSWER_SECONDS = 3.0  # how long a GCS may take to answer the token probe
# A GCS method any client calls first, with no arguments (an empty message is its request).
CLUSTER_ID_METHOD = "/ray.rpc.NodeInfoGcsService/GetClusterId"


def check_token(address: str, key: str = "ray.address") -> None:
    """The cluster's GCS at `address` (`host:port`) accepts this client: one gRPC call carrying
    the token as Ray's clients send it, which is only with RAY_AUTH_MODE=token. A refusal is a
    one-line FederationError: without RAY_AUTH_MODE=token, that it needs it; with it, where the
    refused token came from. Ray itself retries for 20 s and then names only the address. Any
    other outcome is left to Ray, and so is a cluster with TLS (RAY_USE_TLS)."""
    if _tls():
        return
    target = address.split("://", 1)[-1]
    if _host_port(target) is None:
        return
    import grpc

    from silo_pfl.runtime.jobs import auth_token, token_source

    mode = os.environ.get("RAY_AUTH_MODE", "").lower() == "token"
    token = auth_token() if mode else None
    metadata = [("authorization", f"Bearer {token}")] if token else []
    try:
        with grpc.insecure_channel(target) as channel:
            channel.unary_unary(CLUSTER_ID_METHOD)(
                b"", metadata=metadata, timeout=TOKEN_ANSWER_SECONDS
            )
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.UNAUTHENTICATED:
            return
    else:
        return
    if not mode:
        raise FederationError(
            f"{key}: the cluster at {address} uses token authentication; set RAY_AUTH_MODE=token, "
            "with its token in RAY_AUTH_TOKEN or ~/.ray/auth_token"
        )
    if token is None:
        raise FederationError(
            f"{key}: the cluster at {address} needs its token, and none is set; give it in "
            "RAY_AUTH_TOKEN or ~/.ray/auth_token (RAY_AUTH_MODE=token)"
        )
    raise FederationError(
        f"{key}: the cluster at {address} refused the token ({token_source()[0]}); give the "
        "cluster's own token in RAY_AUTH_TOKEN or ~/.ray/auth_token"
    )


def _host_port(address: str) -> tuple[str, int] | None:
    """`host:port` (the host maybe in brackets) as (host, port); None for another form."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def _tls() -> bool:
    """Whether Ray's connections use TLS (RAY_USE_TLS), as Ray reads it."""
    return os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true")


def not_http2(conn: socket.socket, timeout: float) -> str | None:
    """None if the server on `conn` answers an HTTP/2 client's preface with a SETTINGS frame, as
    every gRPC server does; else what it did instead, in a few words."""
    deadline = time.monotonic() + timeout
    got = b""
    try:
        conn.sendall(HTTP2_PREFACE)
        while len(got) < FRAME_HEADER:
            conn.settimeout(max(0.01, deadline - time.monotonic()))
            chunk = conn.recv(1024)
            if not chunk:
                break
            got += chunk
    except TimeoutError:
        if not got:
            return f"no answer to HTTP/2 within {timeout:g} s"
    except OSError as exc:
        return f"the connection failed: {exc.strerror or type(exc).__name__}"
    if len(got) >= FRAME_HEADER and got[3] == HTTP2_SETTINGS and got[5:9] == bytes(4):
        return None
    if not got:
        return CLOSED
    text = got.decode("ascii", "replace")
    if text.replace("\r", "").replace("\n", "").replace("\t", "").isprintable():
        line = (text.strip().splitlines() or [""])[0][:60]
        return f"it answers in plain text, as HTTP/1 does: {line!r}"
    return "it does not speak HTTP/2"


SOCKET_PATH_TOO_LONG = "validate_socket_filename"  # Ray's OSError for an AF_UNIX path too long
SOCKET_PATH_MAX = 107  # bytes, AF_UNIX on Linux


def _socket_dir_too_long(message: str) -> str:
    """The line for Ray's refusal of a socket path under a temporary directory too long."""
    variable = "RAY_TMPDIR" if os.environ.get("RAY_TMPDIR") else "TMPDIR"
    directory = tempfile.gettempdir() if variable == "TMPDIR" else os.environ["RAY_TMPDIR"]
    path = message.rsplit(": ", 1)[-1].strip()
    over = len(path.encode()) - SOCKET_PATH_MAX
    most = len(directory.encode()) - over if over > 0 and path.startswith(directory) else None
    allowed = f"at most {most} bytes long" if most and most > 0 else "shorter"
    return (
        f"{variable}: Ray's sockets under {directory} would exceed the {SOCKET_PATH_MAX} bytes "
        f"an AF_UNIX path may have; set {variable} to a directory path {allowed}, e.g. /tmp/ray"
    )


def shutdown_local() -> None:
    """`ray.shutdown` of a local instance this process started, without its one-second wait."""
    try:
        stop_autoscaler_monitor()
    finally:
        ray.shutdown()


T = TypeVar("T")


@contextmanager
def ray_session_while(draft: FederationConfig, load: Callable[[], T]) -> Iterator[T]:
    """A run's Ray session, started while `load` runs on a thread; yields what `load` returned.

    `load` is the rest of a run's set-up on the driver, chiefly importing torch and checking the
    config against the registries; Ray's start is mostly waiting on its own processes, so the two
    overlap. `draft` is the config as merged and range-checked (`config.merge_config`): it gives
    ray.* and metrics.*, which the registries' checks never change. An error of `load` is raised
    once Ray is stopped again, so a config that only the registries refuse costs Ray's start.
    """
    with ThreadPoolExecutor(1, thread_name_prefix="silo-pfl-load") as pool:
        loaded = pool.submit(load)
        with ray_session(draft.ray, metrics_interval_s=export_interval(draft)):
            yield loaded.result()


# The largest object a local instance's calls return inline, in the reply to the caller, rather
# than through the shared-memory object store (Ray's default: 100 KiB). Each object in the store
# costs several requests to the raylet, from its writer, its reader and its owner, and a packed
# worker returns all its silos' updates as one object: for a small model, five of them pass
# 100 KiB. Larger objects, a large model's state and updates, still go through the store, which
# its readers on the node map without a copy.
INLINE_BYTES = 1 << 20


def local_options(cfg: RayConfig) -> dict[str, Any]:
    """ray.init's options for a fresh local instance, without Ray's dashboard (a fresh dict each
    call: `ray.init` adds to its system settings)."""
    return {
        "address": "local",
        "num_cpus": cfg.num_cpus,
        "include_dashboard": False,
        "log_to_driver": False,
        "logging_level": logging.WARNING,
        "_system_config": {"max_direct_call_object_size": INLINE_BYTES},
    }


def stop_autoscaler_monitor() -> None:
    """Kill the autoscaler monitor of the local instance this process started, before
    `ray.shutdown`. A local instance has nothing to autoscale, and Ray stops the monitor after its
    GCS: on SIGTERM the monitor then tries to report to that GCS and is killed a second later,
    which made every local shutdown wait a second. Ray's node object is private: where it has
    another shape, this does nothing and the shutdown waits as before."""
    node = getattr(ray._private.worker, "_global_node", None)
    infos = getattr(node, "all_processes", {}).get("monitor", [])
    for info in infos:
        process = getattr(info, "process", None)
        if process is not None and process.poll() is None:
            process.kill()
            process.wait(timeout=5)


@contextmanager
def quiet_token_notice() -> Iterator[None]:
    """While a local Ray starts: without Ray's warning line that token authentication is on
    (it stays on). On stderr it stood before every local run's output, one-line errors too."""
    notice = logging.getLogger("ray._private.authentication.authentication_token_setup")
    level = notice.level
    notice.setLevel(logging.ERROR)
    try:
        yield
    finally:
        notice.setLevel(level)


@contextmanager
def _export_interval(seconds: float | None) -> Iterator[None]:
    """While a local Ray starts, RAY_metrics_report_interval_ms for the processes it spawns (they
    inherit it; its workers from its raylet), unless the environment sets it already."""
    name = "RAY_metrics_report_interval_ms"
    if seconds is None or name in os.environ:
        yield
        return
    os.environ[name] = str(round(seconds * 1000))
    try:
        yield
    finally:
        del os.environ[name]
