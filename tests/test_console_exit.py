"""The `silo-pfl` command's exit (cli.console): main's exit code, with what is left in memory
frozen first, so that the interpreter's last collections skip it (docs/BENCHMARKS.md)."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Runs the console entry as the installed command does; an atexit handler registered before it
# runs at exit, after console() returned through sys.exit, and reports how much was frozen.
PROGRAM = """
import atexit, gc, sys
atexit.register(lambda: print(f"frozen {gc.get_freeze_count()}", file=sys.stderr))
from silo_pfl.cli import console
sys.argv = ["silo-pfl", *sys.argv[1:]]
console()
"""


def _console(*args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-c", PROGRAM, *args]
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_the_installed_command_is_the_console_entry():
    scripts = entry_points(group="console_scripts")
    assert scripts["silo-pfl"].value == "silo_pfl.cli:console"


def test_the_console_exits_with_mains_code_and_freezes_what_is_left():
    done = _console("config", "jobs/heart_disease.yaml", "rounds=3")
    assert done.returncode == 0, done.stderr
    assert "rounds: 3" in done.stdout
    frozen = int(done.stderr.rsplit("frozen ", 1)[1].split()[0])
    assert frozen > 10_000  # the modules' objects, torch's and OmegaConf's among them


def test_the_console_keeps_a_user_errors_exit_code():
    done = _console("config", "jobs/heart_disease.yaml", "rounds=-1")
    assert done.returncode == 2
    assert done.stderr.startswith("error: rounds:"), done.stderr
