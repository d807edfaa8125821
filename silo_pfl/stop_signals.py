"""SIGTERM as Ctrl-C: what `ray job stop`, `silo-pfl stop`, a CI's timeout or `kill` send stops
the work as Ctrl-C does, raising `errors.Interrupted`, so that the clean-up runs (actors released,
workers and their Ray stopped, temporary directories deleted). And signals held while a local Ray
starts, which an interruption there would leave half-started, or deferred while a store writes,
which an interruption there would leave holding its lock."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

from silo_pfl.errors import Interrupted

_received: list[int] = []  # the SIGTERM that `interrupt` turned into Interrupted, if any


def interrupt(signum: int, frame: Any) -> None:
    """A SIGTERM handler: raise Interrupted once; a second SIGTERM cannot cut the clean-up short."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _received.append(signum)
    raise Interrupted(signum)


def cause(exc: KeyboardInterrupt) -> int:
    """The signal behind `exc`: its own, else the SIGTERM `interrupt` raised on (Ray may turn an
    interrupted wait into a plain KeyboardInterrupt), else SIGINT, Ctrl-C's."""
    signum = getattr(exc, "signum", None)
    if signum is not None:
        return int(signum)
    return _received[-1] if _received else signal.SIGINT


@contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """While inside, SIGTERM raises Interrupted (in the main thread; elsewhere, nothing
    changes); the previous handler is put back after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, interrupt)
    _received.clear()
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def sigterm_interrupts_unless_set() -> AbstractContextManager[None]:
    """`sigterm_interrupts`, unless a session around this one (or its caller) has put it in
    force already: that one's clean-up after a SIGTERM, which ignores a second, must not find
    the handler put back by this one."""
    if signal.getsignal(signal.SIGTERM) is interrupt:
        return nullcontext()
    return sigterm_interrupts()


@contextmanager
def signals_held() -> Iterator[list[int]]:
    """Ctrl-C and SIGTERM take effect after the block: `ray.init` interrupted half-way leaves
    processes (its GCS, its agents) that no shutdown can reach, for a minute or more. Yields the
    signals that came meanwhile."""
    held: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield held
        return

    def hold(signum: int, frame: Any) -> None:
        held.append(signum)

    # A handler put back raises for a signal that came meanwhile at the next Python step, which
    # may come before the other is put back: that `hold` would outlive the block and swallow
    # every later signal. So each handler is recorded before it is replaced, and putting them
    # back is repeated until a pass ends with none raising; the first exception then goes on.
    previous: dict[int, Any] = {}
    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            got = signal.getsignal(sig)
            previous[sig] = got if got is not None else signal.SIG_DFL  # None: set outside Python
            signal.signal(sig, hold)
        yield held
    finally:
        raised: BaseException | None = None
        while True:
            try:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)
                break
            except BaseException as exc:
                raised = raised or exc
        if raised is not None:
            raise raised


@contextmanager
def signals_deferred() -> Iterator[None]:
    """Ctrl-C and SIGTERM take effect as the block ends, through the handlers in force before
    it (Interrupted, KeyboardInterrupt, or ignored during a clean-up): the block is never cut
    in half. For short calls only: it cannot be stopped while it runs."""
    held: list[int] = []
    try:
        with signals_held() as held:
            yield
    finally:
        for signum in dict.fromkeys(held):
            signal.raise_signal(signum)
