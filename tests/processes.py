"""Processes a test starts in their own session: waiting for one to answer over HTTP, and
stopping it with everything it started, by its process group (never by name)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest


def stop_group(proc: subprocess.Popen, timeout: float = 15) -> None:
    """SIGTERM the process group of `proc` (started with start_new_session=True); once `proc`
    has exited, or after `timeout` seconds, SIGKILL whatever of its group is left."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=timeout)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def wait_for_http(url: str, proc: subprocess.Popen, log: Path, what: str, seconds: float) -> None:
    """Until `url` answers 200 within `seconds`; fail, with the end of `log`, if `proc` exits or
    the time runs out."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"{what} exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as answer:
                if answer.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            time.sleep(0.5)
    pytest.fail(f"{what} did not answer {url} in {seconds} s")


@contextlib.contextmanager
def mlflow_server(directory: Path, port: int) -> Iterator[subprocess.Popen]:
    """A real `mlflow server` on 127.0.0.1:`port`, its store and artifacts in `directory`, in a
    session of its own; stopped by its process group when the block ends."""
    command = [str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1"]
    command += ["--port", str(port), "--backend-store-uri", f"sqlite:///{directory / 'srv.db'}"]
    command += ["--artifacts-destination", str(directory / "srv-artifacts"), "--workers", "1"]
    log = directory / "mlflow-server.log"
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    with log.open("w") as out:
        server = subprocess.Popen(
            command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        wait_for_http(f"http://127.0.0.1:{port}/health", server, log, "mlflow server", 120)
        yield server
    finally:
        stop_group(server)
