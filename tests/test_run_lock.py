"""One driver at a time per run: a second server of the same run, in another process (as a
second `--resume` started while the first runs), is refused in one line naming the holder; once
that process is gone, the run is free again. Real kernel locks, between real processes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from silo_pfl.config import to_dict
from silo_pfl.errors import FederationError
from silo_pfl.run_dir import server_dir
from silo_pfl.server_start import new_server
from silo_pfl.settings import load_config

ROOT = Path(__file__).resolve().parents[1]
PROBE = """
import sys
from pathlib import Path
from silo_pfl import run_lock
from silo_pfl.errors import FederationError
try:
    run_lock.hold(Path(sys.argv[1]), "r")
except FederationError:
    print("held")
else:
    print("free")
"""
HOLD = """
import sys, time
from pathlib import Path
from silo_pfl import run_lock
run_lock.hold(Path(sys.argv[1]), "r")
print("held", flush=True)
time.sleep(600)
"""


def test_a_second_server_of_a_run_is_refused_while_another_process_serves_it(tmp_path):
    cfg = load_config(ROOT / "jobs" / "heart_disease.yaml", [f"output_dir={tmp_path}"])
    config = to_dict(cfg)
    directory = server_dir(cfg, "20261206-000000-abc123")
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(directory)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with pytest.raises(FederationError) as info:
            new_server(config, (13,), 2, "20261206-000000-abc123")
        assert str(info.value) == (
            f"run 20261206-000000-abc123: another driver is running it (the server of pid "
            f"{holder.pid} holds {directory / '.lock'}); stop that run or wait for it to end, "
            "then --resume"
        )
    finally:
        holder.kill()
        holder.wait()
    server = new_server(config, (13,), 2, "20261206-000000-abc123")
    again = new_server(config, (13,), 2, "20261206-000000-abc123")  # this process holds it
    server.release()
    assert _held_elsewhere(directory) is True, "its other server still holds it"
    del again  # a server dropped without release lets go too
    assert _held_elsewhere(directory) is False


def _held_elsewhere(directory: Path) -> bool:
    """Whether another process would find the run's lock held."""
    probe = subprocess.run(
        [sys.executable, "-c", PROBE, str(directory)], capture_output=True, text=True, timeout=60
    )
    return probe.stdout.strip() == "held"
