"""Two processes that open a new SQLite store together (two seeds started at once in a fresh
directory) both get it: MLflow's building of its tables is one process's at a time. Two that
interleaved it left a half-built store that no later run could open."""

from __future__ import annotations

import fcntl
import os
import shutil
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

from silo_pfl.tracking.store import check_store, open_client

OPEN = """
import os, sys, time
from silo_pfl.tracking.store import ensure_experiment, open_client
import mlflow
print("ready", flush=True)
while not os.path.exists(sys.argv[2]):
    time.sleep(0.0005)
client = open_client(sys.argv[1], "tracking.uri")
print("ok", ensure_experiment(client, sys.argv[1], "race", "tracking.uri"))
"""


def test_two_processes_opening_a_new_sqlite_store_together_both_get_it(tmp_path):
    for attempt in range(2):
        folder = tmp_path / str(attempt)
        folder.mkdir()
        uri, go = f"sqlite:///{folder / 'mlflow.db'}", tmp_path / f"go-{attempt}"
        openers = [
            subprocess.Popen(
                [sys.executable, "-c", OPEN, uri, str(go)],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                cwd=Path(__file__).parent.parent,
            )
            for _ in range(2)
        ]
        for opener in openers:  # both have imported MLflow: they open the store at once
            assert opener.stdout is not None and opener.stdout.readline() == "ready\n"
        go.touch()
        outputs = [opener.communicate(timeout=120)[0] for opener in openers]
        for opener, output in zip(openers, outputs, strict=True):
            assert opener.returncode == 0 and output.startswith("ok "), output[-2000:]
        assert len({output.split()[1] for output in outputs}) == 1, "one experiment"


def test_a_store_another_process_is_building_is_checked_once_it_is_built(tmp_path):
    """A run's early check of its store waits while another process holds the store's
    directory to build its tables, rather than refusing a half-built file as no MLflow store."""
    built = tmp_path / "built" / "mlflow.db"
    built.parent.mkdir()
    open_client(f"sqlite:///{built}", "tracking.uri")
    building = tmp_path / "building" / "mlflow.db"
    building.parent.mkdir()
    with sqlite3.connect(building) as db:  # the first of MLflow's tables only
        db.execute("CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL)")
    guard = os.open(building.parent, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(guard, fcntl.LOCK_EX)
    errors: list[BaseException] = []

    def check() -> None:
        try:
            check_store(f"sqlite:///{building}", "tracking.uri")
        except BaseException as error:
            errors.append(error)

    checking = threading.Thread(target=check)
    checking.start()
    checking.join(1.0)
    assert checking.is_alive() and not errors, errors
    shutil.copyfile(built, building)
    os.close(guard)
    checking.join(30)
    assert not checking.is_alive() and errors == []
