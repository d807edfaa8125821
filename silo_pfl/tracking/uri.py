"""MLflow store URIs, checked at config load without importing MLflow.

The default store is embedded: `sqlite:///mlflow.db` in the working directory (or
$MLFLOW_TRACKING_URI when set). A SQLite store keeps its artifacts beside the database, in
`<db dir>/mlartifacts/<experiment>`, created on demand, so nothing has to be started. MLflow's
file store (`file:` URIs, and plain paths, which MLflow reads as one) is in maintenance mode and
refuses to open, so neither is taken.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit

from silo_pfl import node_env
from silo_pfl.errors import PASSWORD_MASK, SECRET_QUERY, URL_PASSWORD, ConfigError

DEFAULT_URI = "sqlite:///mlflow.db"
ENV_URI = "MLFLOW_TRACKING_URI"
ARTIFACTS_DIR = "mlartifacts"
SQLITE_PREFIX = "sqlite:///"
SCHEMES = ("sqlite", "postgresql", "mysql", "mssql", "http", "https", "databricks")
EXAMPLES = "e.g. sqlite:///mlflow.db or http://host:5000"
FILE_STORE = "; MLflow's file store is retired, a local store is sqlite:///PATH"
ESCAPES = "a / ? # or @ in a user name or password is written %2F %3F %23 %40"


def check_uri(uri: str, key: str) -> str:
    """The URI, stripped, if MLflow can use it as a tracking and registry store: a known scheme,
    a SQLite database file, and an http(s) port that is a number (see check_port)."""
    uri = str(uri).strip()
    named = scheme(uri)
    if named not in SCHEMES:
        retired = FILE_STORE if named in ("", "file") else ""
        raise ConfigError(
            f"{key}: got {redact(uri)!r}, expected an MLflow store URI with a scheme among "
            f"{', '.join(SCHEMES)} ({EXAMPLES}){retired}"
        )
    if named == "sqlite" and sqlite_target(uri) in ("", ":memory:"):
        raise ConfigError(f"{key}: got {redact(uri)!r}, expected sqlite:///PATH to a database file")
    if named in ("http", "https"):
        check_port(uri, key)
    return uri


def scheme(uri: str) -> str:
    """The store's kind: the URI's scheme without a driver (mysql+pymysql is mysql)."""
    return "databricks" if uri == "databricks" else urlsplit(uri).scheme.split("+")[0]


def check_port(uri: str, key: str) -> None:
    """A one-line ConfigError for an http(s) URI whose port is not a number. urllib reads the
    port after the authority's last ':', and the authority ends at the first '/', '?' or '#': so
    http://admin:Tr0ub4dor/3xyz@host:5000 has the "port" 'Tr0ub4dor', which http.client would
    echo in its error. The URI is shown redacted."""
    parts = urlsplit(uri)
    try:
        parts.port  # noqa: B018 - raises ValueError for a port urllib cannot read
    except ValueError:
        shown = redact(uri)
        masked = " (password masked)" if shown != uri else ""
        raise ConfigError(
            f"{key}: got {shown!r}{masked}, expected {parts.scheme}://host:PORT with a numeric "
            f"PORT (0-65535), or no port; {ESCAPES}"
        ) from None


def node_uri(uri: str, key: str, silo: str) -> str:
    """A silo's own store URI as its node sees it: `$NAME`s filled in from this process's
    environment (the silo's, on its node), then checked as `check_uri` does. A variable the node
    does not set is a one-line ConfigError naming it, the key and the silo."""
    expanded, unset = node_env.expand(uri)
    if unset:
        raise ConfigError(
            f"{key}: environment variable {unset} is not set on silo {silo}'s node; "
            f"{node_env.pin_hint(silo)}. A literal $ in the URI (in a password, say) is written "
            "%24, as URIs escape it"
        )
    return check_uri(expanded, key)


def sqlite_target(uri: str) -> str:
    """What follows `sqlite:///`: a relative path, or an absolute one starting with '/'."""
    if not uri.startswith(SQLITE_PREFIX):
        return ""
    return uri[len(SQLITE_PREFIX) :].split("?")[0]


def sqlite_path(uri: str) -> Path | None:
    """The database file of a SQLite URI, its %XX escapes decoded as SQLAlchemy decodes them (a
    literal $ is %24), or None for other stores."""
    return Path(unquote(sqlite_target(uri))) if uri.startswith(SQLITE_PREFIX) else None


def resolve_uri(uri: str | None, key: str) -> str:
    """The central store: the given URI, else $MLFLOW_TRACKING_URI, else the embedded SQLite.

    A relative SQLite path is made absolute against the driver's working directory, so that every
    process of the run (silo actors too) opens the same database.
    """
    if not uri and os.environ.get(ENV_URI):
        uri, key = os.environ[ENV_URI], f"{key} (from ${ENV_URI})"
    chosen = check_uri(uri or DEFAULT_URI, key)
    path = sqlite_path(chosen)
    if path is not None and not path.is_absolute():
        query = chosen[len(SQLITE_PREFIX) + len(sqlite_target(chosen)) :]
        chosen = f"{SQLITE_PREFIX}{quote(str(path.resolve()))}{query}"
    return chosen


def artifact_dir(uri: str, experiment: str) -> Path | None:
    """Where a SQLite store keeps an experiment's artifacts: <db dir>/mlartifacts/<experiment>."""
    path = sqlite_path(uri)
    return None if path is None else path.resolve().parent / ARTIFACTS_DIR / experiment


def redact(uri: str) -> str:
    """The URI without its password or secret query values, for params, results and messages.

    The password is everything from the first ':' after `scheme://` (with no '/' before it) to
    the URI's last '@', shown as ***: postgresql://admin:***@db/mlflow. That covers a password
    with an unescaped '/', '?', '#' or '@', which SQLAlchemy takes whole
    (postgresql://admin:Tr0ub4dor/3xyz@db/mlflow) while urllib ends the authority before it, and
    what urllib reads as one (up to the authority's last '@'). A URI with no password but an '@'
    in its path or query after a host:port is masked from the port on: more hidden, never less
    (errors.URL_PASSWORD).
    """
    redacted = URL_PASSWORD.sub(PASSWORD_MASK, uri)
    parts = urlsplit(redacted)
    query = "&".join(
        f"{name}=***" if sep and SECRET_QUERY.search(name) else f"{name}{sep}{value}"
        for name, sep, value in (item.partition("=") for item in parts.query.split("&"))
    )
    if query != parts.query:
        redacted = redacted.replace(f"?{parts.query}", f"?{query}", 1)
    return redacted
