"""Opening an MLflow store and a federation's experiment, with one-line errors before round 1.

Checked before anything trains: a SQLite store's directory exists and is writable, an HTTP store
answers, the store opens, the experiment is not deleted, and a local artifact location takes a
file. A SQLite store's new experiment keeps its artifacts in <db dir>/mlartifacts/<experiment>.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import functools
import http.client
import logging
import os
import sqlite3
import ssl
import tempfile
import urllib.error
import urllib.request
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote, unquote, urlsplit

from silo_pfl import node_env
from silo_pfl.errors import ConfigError, FederationError, one_line
from silo_pfl.paths import nearest_existing
from silo_pfl.tracking.uri import (
    ESCAPES,
    artifact_dir,
    check_port,
    redact,
    resolve_uri,
    sqlite_path,
)
from silo_pfl.tracking.whole_calls import whole_calls

if TYPE_CHECKING:
    from mlflow import MlflowClient

# Where MLflow's client (through requests) finds the CA to trust, first to last.
CA_VARIABLES = ("MLFLOW_TRACKING_SERVER_CERT_PATH", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE")
HEALTH_TIMEOUT_SECONDS = 20.0  # a server busy starting up answers slowly on 2 cores
# Tables every MLflow SQLite store has: an existing file without them is not a store to read
# (MLflow would add its whole schema to it).
MLFLOW_TABLES = ("alembic_version", "experiments")


def quiet() -> None:
    """Keep MLflow's logs (a new SQLite store's migrations, pickling advice), warnings and
    download progress bars (drawn with tqdm, a dependency of the CLI's own bar) quiet, unless
    MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR asks for them.

    Failures still surface, as exceptions.
    """
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    logging.getLogger("mlflow").setLevel(logging.ERROR)
    logging.getLogger("alembic").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", module=r"mlflow(\.|$)")
    warnings.filterwarnings("ignore", module=r"alembic(\.|$)")


def _check_sqlite(uri: str, key: str) -> None:
    path = sqlite_path(uri)
    if path is None:
        return
    if path.is_dir():
        raise ConfigError(f"{key}: {path} is a directory, expected a SQLite database file")
    if not path.parent.is_dir():
        raise ConfigError(f"{key}: directory {path.parent} of the SQLite store does not exist")
    if path.exists():
        if path.stat().st_size:  # an empty file becomes a store; another database does not
            with _one_opener(uri):  # a store another process is building, once it is built
                _check_mlflow_tables(path, key, redact(uri), "or at a new file for a new store")
        return
    _probe(path.parent, f"{key}: directory {path.parent} of the SQLite store is not writable")


def _tls_context() -> ssl.SSLContext:
    """The trust MLflow's client gives an HTTPS store: MLFLOW_TRACKING_INSECURE_TLS=true (or 1)
    trusts any certificate, MLFLOW_TRACKING_SERVER_CERT_PATH (else requests' REQUESTS_CA_BUNDLE
    or CURL_CA_BUNDLE) names the CA to trust, MLFLOW_TRACKING_CLIENT_CERT_PATH a client
    certificate with its key."""
    if os.environ.get("MLFLOW_TRACKING_INSECURE_TLS", "").strip().lower() in ("true", "1"):
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    else:
        cafile = next((os.environ[v] for v in CA_VARIABLES if os.environ.get(v, "").strip()), None)
        context = ssl.create_default_context(cafile=cafile or None)
    client = os.environ.get("MLFLOW_TRACKING_CLIENT_CERT_PATH")
    if client:
        context.load_cert_chain(client)
    return context


def _check_server(uri: str, key: str) -> None:
    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https"):
        return
    check_port(uri, key)  # before http.client echoes it (InvalidURL: nonnumeric port: '...')
    try:
        # urllib takes no user:password@ in a URL: the credentials go in a header, as MLflow's do.
        host = parts._replace(netloc=parts.netloc.rpartition("@")[2], query="", fragment="")
        request = urllib.request.Request(host.geturl().rstrip("/") + "/health")
        if parts.username is not None:
            user = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
            auth = base64.b64encode(user.encode()).decode()
            request.add_header("Authorization", "Basic " + auth)
        context = _tls_context() if parts.scheme == "https" else None
        urllib.request.urlopen(request, timeout=HEALTH_TIMEOUT_SECONDS, context=context).close()
    except urllib.error.HTTPError:
        return  # something answers; the store calls below tell whether it is MLflow
    except (http.client.InvalidURL, ValueError) as exc:
        # Their messages quote the URL or a header, a password's part among them: named only.
        raise ConfigError(
            f"{key}: cannot send a request to {redact(uri)} ({type(exc).__name__}); expected "
            f"{parts.scheme}://[USER:PASSWORD@]HOST[:PORT]; {ESCAPES}"
        ) from None
    except OSError as exc:
        reason = getattr(exc, "reason", exc)
        if isinstance(reason, ssl.SSLCertVerificationError):
            raise FederationError(
                f"{key}: the server at {redact(uri)} does not show a certificate this machine "
                f"trusts ({one_line(reason)}); set MLFLOW_TRACKING_SERVER_CERT_PATH to its CA's "
                "certificate"
            ) from None
        raise FederationError(
            f"{key}: no MLflow server answers at {redact(uri)} ({one_line(reason)})"
        ) from None


def check_store(uri: str, key: str) -> None:
    """The checks that need no MLflow: a SQLite store's directory, an HTTP store's answer."""
    _check_sqlite(uri, key)
    _check_server(uri, key)


@contextlib.contextmanager
def _one_opener(uri: str) -> Iterator[None]:
    """For a SQLite store, one process of this machine at a time opens it first: MLflow builds a
    new file's tables (or upgrades an older one's) in some 70 steps, and two processes that
    interleave them leave a half-built store no later run can open (two seeds started together
    in a fresh directory). An exclusive lock on the file's directory, which leaves no file
    behind; where the file system takes no lock, MLflow opens the store unguarded."""
    path = sqlite_path(uri)
    if path is None:
        yield
        return
    try:
        guard = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        yield
        return
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(guard, fcntl.LOCK_EX)
        yield
    finally:
        os.close(guard)  # and with it the lock


@functools.lru_cache(maxsize=8)
def open_client(uri: str, key: str) -> MlflowClient:
    """A client of the store at `uri` (tracking and registry), checked; one per process and URI."""
    check_store(uri, key)
    from mlflow import MlflowClient

    quiet()  # after the import, which sets MLflow's own log level

    try:
        with _one_opener(uri):
            client = MlflowClient(tracking_uri=uri, registry_uri=uri)
            client.search_experiments(max_results=1)
    except Exception as exc:
        raise FederationError(
            f"{key}: cannot open the MLflow store {redact(uri)}: {one_line(exc)}"
        ) from None
    return whole_calls(client, uri)


def open_existing(uri: str | None, key: str) -> tuple[MlflowClient, str]:
    """A store that runs were logged to already (what `silo-pfl models` and `report` read): a
    client and the resolved URI. A SQLite file that is not there, or is no MLflow store (an
    empty file among them), is a one-line error, and the file is left as it was. `$NAME`s are
    filled in from the environment, as on a silo's node for its own store: the command the
    run prints for such a store is run there, the URI quoted as configured."""
    if uri is not None:
        uri, unset = node_env.expand(uri)
        if unset:
            raise ConfigError(f"{key}: environment variable {unset} is not set")
    uri = resolve_uri(uri, key)
    path = sqlite_path(uri)
    if path is not None and not path.is_file():
        raise ConfigError(
            f"{key} {redact(uri)}: no MLflow store at {path}; run a federation first, or point "
            f"{key} at its store"
        )
    if path is not None:
        _check_mlflow_tables(path, key, redact(uri), "(its tracking.uri)")
    return open_client(uri, key), uri


def _check_mlflow_tables(path: Path, key: str, uri: str, other: str) -> None:
    """The SQLite file at `path` (of `key`'s `uri`) has MLflow's tables; read through a
    read-only connection, so that nothing, not even a journal, is written to it. `other`: what
    else the error suggests pointing `key` at."""
    try:
        with contextlib.closing(
            sqlite3.connect(f"file:{quote(str(path.resolve()))}?mode=ro", uri=True)
        ) as db:
            rows = db.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall()
    except sqlite3.Error as exc:
        what = one_line(exc)
    else:
        missing = [t for t in MLFLOW_TABLES if t not in {name for (name,) in rows}]
        if not missing:
            return
        what = f"no {' or '.join(missing)} table" if rows else "it holds no table"
    raise ConfigError(
        f"{key} {uri}: {path} is not an MLflow store ({what}); point {key} at the store a "
        f"federation ran with {other}"
    )


def check_experiment(client: MlflowClient, uri: str, name: str, key: str) -> str | None:
    """The id of experiment `name` if it exists (None if not), checked as `ensure_experiment`
    would use it, without creating it: not deleted, and its artifact location (or the one it
    would get) takes a file."""
    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        location = artifact_dir(uri, name)
        if location is not None:
            _writable_dir(location, key)
        return None
    if experiment.lifecycle_stage != "active":
        raise ConfigError(
            f"name: experiment {name!r} is deleted in {redact(uri)} ({key}); restore it "
            f"(mlflow experiments restore) or choose another federation name"
        )
    check_artifact_dir(experiment.artifact_location, key)
    return str(experiment.experiment_id)


def ensure_experiment(client: MlflowClient, uri: str, name: str, key: str) -> str:
    """The id of experiment `name`, created if absent; its artifact location must take a file."""
    found = check_experiment(client, uri, name, key)
    if found is not None:
        return found
    location = artifact_dir(uri, name)
    try:
        client.create_experiment(name, location.as_uri() if location else None)
    except Exception as exc:
        if client.get_experiment_by_name(name) is None:  # else another process won the race
            raise FederationError(
                f"{key}: cannot create experiment {name!r} in {redact(uri)}: {one_line(exc)}"
            ) from None
    experiment = client.get_experiment_by_name(name)
    check_artifact_dir(experiment.artifact_location, key)
    return str(experiment.experiment_id)


def check_artifact_dir(location: str, key: str) -> None:
    """A local artifact location (a path or file://) must exist or be creatable, and writable."""
    local = _local_path(location)
    if local is not None:
        _writable_dir(local, key)


def _local_path(location: str) -> Path | None:
    parts = urlsplit(location)
    if parts.scheme == "file":
        return Path(unquote(parts.path))
    return Path(location) if not parts.scheme else None


def _writable_dir(path: Path, key: str) -> None:
    """Prove the artifact directory can be written in, or, while it does not exist, made (in
    its nearest existing parent) without making it: MLflow makes it when it first writes."""
    existing = nearest_existing(path)
    if not existing.is_dir():
        raise ConfigError(
            f"{key}: artifact location {path} cannot be created ({existing} is not a directory)"
        )
    where = "is not writable" if existing == path else f"cannot be created in {existing}"
    _probe(existing, f"{key}: artifact location {path} {where}")


def _probe(directory: Path, message: str) -> None:
    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".silo_pfl_probe"):
            pass
    except OSError as exc:
        raise ConfigError(f"{message} ({exc.strerror or one_line(exc)})") from None
