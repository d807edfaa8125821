"""A SQLite store's client whose calls a signal cannot cut in half.

Ctrl-C or SIGTERM raised inside MLflow's SQLAlchemy code leaves the interrupted session's
connection holding the database's write lock while the exception (and its frames) lives: the
clean-up's own writes (runs marked KILLED) then wait out SQLite's busy timeout, 20 s, and fail.
So each call to such a store finishes first and the signal takes effect as it returns
(`stop_signals.signals_deferred`); a local file's call is short. Any other store's calls stay
interruptible: an HTTP server keeps its own transactions, and a store across the network that
stops answering (an HTTP server, a PostgreSQL host) could hold a Ctrl-C for minutes.
"""

from __future__ import annotations

import functools
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any, cast

from silo_pfl.stop_signals import signals_deferred
from silo_pfl.tracking.uri import scheme

if TYPE_CHECKING:
    from mlflow import MlflowClient


class WholeCalls:
    """Wraps an MlflowClient: each of its methods runs with signals deferred."""

    def __init__(self, client: MlflowClient) -> None:
        self._client = client

    def __getattr__(self, name: str) -> Any:
        if name == "_client" or name.startswith("__"):  # a copy or unpickling, before __init__
            raise AttributeError(name)
        attr = getattr(self._client, name)
        if not callable(attr):
            return attr

        @functools.wraps(attr)
        def whole(*args: Any, **kwargs: Any) -> Any:
            with signals_deferred():
                return attr(*args, **kwargs)

        return whole


def whole_steps(uri: str) -> AbstractContextManager[None]:
    """For a SQLite store, around a call and the lines that record what it made: a signal takes
    effect after them all (else a clean-up never learns of what was made); else nothing."""
    return signals_deferred() if local_database(uri) else nullcontext()


def local_database(uri: str) -> bool:
    """Whether the store is a SQLite file, whose calls are made whole."""
    return scheme(uri) == "sqlite"


def whole_calls(client: MlflowClient, uri: str) -> MlflowClient:
    """For a SQLite store, `client` with its calls made whole; any other's, itself."""
    return cast("MlflowClient", WholeCalls(client)) if local_database(uri) else client
