"""`silo-pfl run` starts Ray while it checks its config against the registries (which imports
torch) on a thread; a config that fails its structural checks, or names no built-in algorithm or
model, never starts Ray, and one that only the registries refuse is still a one-line error, with
Ray stopped and nothing written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
JOB = "jobs/heart_disease.yaml"


@pytest.fixture
def ray_tmp() -> Iterator[Path]:
    """A temp dir of Ray's own (RAY_TMPDIR), short enough for its sockets' paths."""
    with tempfile.TemporaryDirectory(prefix="rt", dir="/tmp") as tmp:
        yield Path(tmp)


def _run(ray_tmp: Path, out: Path, *overrides: str) -> tuple[int, int, str]:
    """`silo-pfl run` of the heart-disease job in a fresh process: its pid, exit code, stderr."""
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "RAY_TMPDIR": str(ray_tmp),
        "SILO_PFL_TEST_LOAD_RECORD": str(out / "load.jsonl"),
    }
    command = [sys.executable, "-m", "silo_pfl", "run", JOB, "tracking.enabled=false"]
    command += [f"output_dir={out / 'runs'}", *overrides, "--quiet"]
    proc = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    _, stderr = proc.communicate(timeout=300)
    return proc.pid, proc.returncode, stderr


def _sessions(ray_tmp: Path) -> list[str]:
    return sorted(p.name for p in (ray_tmp / "ray").glob("session_2*"))


def _alive_under(ray_tmp: Path) -> list[int]:
    """Pids of live processes whose command line names `ray_tmp` (Ray's, of that instance)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if proc.name.isdigit() and str(ray_tmp).encode() in cmdline:
            pids.append(int(proc.name))
    return pids


def _refused(ray_tmp: Path, out: Path, override: str, message: str) -> None:
    """The run with `override` exits 2 with the one line `error: <message>...`, writing nothing."""
    _, code, err = _run(ray_tmp, out, override)
    assert code == 2, err[-2000:]
    assert err.startswith(f"error: {message}")
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert not (out / "runs").exists()


@pytest.mark.slow
def test_run_checks_its_config_on_a_thread_while_ray_starts(tmp_path, ray_tmp):
    pid, code, err = _run(ray_tmp, tmp_path, "rounds=1", "plugins=[tests.load_thread_plugins]")
    assert code == 0, err[-2000:]
    records = [json.loads(line) for line in (tmp_path / "load.jsonl").read_text().splitlines()]
    (driver,) = [r for r in records if r["pid"] == pid]
    assert driver["main"] is False and driver["thread"].startswith("silo-pfl-load"), driver
    assert len(_sessions(ray_tmp)) == 1
    assert list((tmp_path / "runs").glob("*/*/result.json"))


@pytest.mark.slow
def test_a_config_only_the_registries_refuse_is_one_line_once_ray_is_stopped(tmp_path, ray_tmp):
    _refused(ray_tmp, tmp_path, "algorithm.fedprox.mu=-1", "algorithm.fedprox.mu: got -1.0")
    assert len(_sessions(ray_tmp)) == 1  # Ray had started beside the check
    assert _alive_under(ray_tmp) == []


@pytest.mark.slow
@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("rounds=abc", "rounds: "),
        ("algorithm.name=fedavgg", "algorithm.name: got 'fedavgg', expected one of apfl, ditto,"),
        ("model.name=vit", "model.name: got 'vit', expected one of cnn_small, cnn_small_bn,"),
    ],
    ids=["structure", "algorithm-name", "model-name"],
)
def test_a_config_refused_by_its_structure_or_a_builtin_name_never_starts_ray(
    tmp_path, ray_tmp, override, message
):
    """A misspelt algorithm or model is refused by the first check, from the built-in names
    (no plugins listed), before torch is imported or Ray started."""
    _refused(ray_tmp, tmp_path, override, message)
    assert _sessions(ray_tmp) == []
