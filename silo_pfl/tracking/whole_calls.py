"""A database-backed store's client whose calls a signal cannot cut in half.

Ctrl-C or SIGTERM raised inside MLflow's SQLAlchemy code leaves the interrupted session's
connection holding the database's write lock while the exception (and its frames) lives: the
clean-up's own writes (runs marked KILLED) then wait out SQLite's busy timeout, 20 s, and fail.
So each call to such a store finishes first and the signal takes effect as it returns
(`stop_signals.signals_deferred`). An HTTP store's calls stay interruptible: the server keeps
its own transactions, and a store that does not answer could hold a Ctrl-C for minutes.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, cast

from silo_pfl.stop_signals import signals_deferred
from silo_pfl.tracking.uri import DATABASE_SCHEMES, scheme

if TYPE_CHECKING:
    from mlflow import MlflowClient


class WholeCalls:
    """Wraps an MlflowClient: each of its methods runs with signals deferred."""

    def __init__(self, client: MlflowClient) -> None:
        self._client = client

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if not callable(attr):
            return attr

        @functools.wraps(attr)
        def whole(*args: Any, **kwargs: Any) -> Any:
            with signals_deferred():
                return attr(*args, **kwargs)

        return whole


def whole_calls(client: MlflowClient, uri: str) -> MlflowClient:
    """`client` itself for an HTTP store; for a database-backed one, its calls made whole."""
    if scheme(uri) not in DATABASE_SCHEMES:
        return client
    return cast("MlflowClient", WholeCalls(client))
