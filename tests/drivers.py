"""Drivers as users start them: `python -m silo_pfl ...` in a session of its own (so a test can
stop exactly what it started, by process group), from the repository's root; and a callback
that stops an in-process driver as Ctrl-C does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from silo_pfl.callbacks import Callback

ROOT = Path(__file__).resolve().parents[1]


def start_driver(args: list[str], env: dict[str, str], **streams: int) -> subprocess.Popen:
    """`silo-pfl <args>` running; stdout and stderr are piped unless `streams` says otherwise."""
    options = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **streams}
    return subprocess.Popen(
        [sys.executable, "-m", "silo_pfl", *args],
        cwd=ROOT,
        env=env,
        text=True,
        start_new_session=True,
        **options,
    )


def until_round(proc: subprocess.Popen, round_: int, rounds: int) -> None:
    """Read the driver's progress until round `round_` of `rounds` has ended; fail the test,
    with the driver's stderr, if the run ended first."""
    assert proc.stdout is not None
    width = len(str(rounds))
    for line in proc.stdout:
        if line.startswith(f"round {round_:>{width}}/{rounds}"):
            return
    raise AssertionError(f"the run ended before round {round_}: {proc.communicate()[1]}")


def run_driver(args: list[str], env: dict[str, str], timeout: float = 300) -> tuple[int, str]:
    """`silo-pfl <args>` to its end: its exit code and stderr."""
    proc = start_driver(args, env, stdout=subprocess.DEVNULL)
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err


def joining_env() -> dict[str, str]:
    """A driver's environment that joins this session's local Ray (`ray_local`), as a Ray Job's
    joins its cluster."""
    import ray

    address = ray.get_runtime_context().gcs_address
    return {**os.environ, "RAY_ADDRESS": address, "RAY_AUTH_MODE": "token"}


class StopAfter(Callback):
    """Stops the driver (as Ctrl-C does) as round `round_` ends, once it is checkpointed and
    before its silos select."""

    def __init__(self, round_: int) -> None:
        self.round = round_

    def on_round_end(self, summary) -> None:
        if summary.round == self.round:
            raise KeyboardInterrupt
