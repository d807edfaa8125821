"""The results JSON is JSON any parser reads: a figure that is not finite is null, not NaN."""

from __future__ import annotations

import json
import os

import numpy as np

from silo_pfl.results import write_json_atomic


def _strict(text: str) -> object:
    """json.loads as a strict parser reads: NaN and Infinity are errors."""

    def refuse(name: str) -> object:
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def test_a_figure_that_is_not_finite_is_written_as_null(tmp_path):
    path = tmp_path / "results.json"
    history = [{"round": 1, "mean_val_accuracy": float("nan")}, {"mean_val_accuracy": 0.75}]
    data = {
        "history": history,
        "extras": (np.float32("inf"), np.float64("-inf"), np.float32(0.5), 3),
        "silos": {"va": {"test_accuracy": np.float64(0.8)}},
    }
    write_json_atomic(path, data)
    assert _strict(path.read_text()) == {
        "history": [{"round": 1, "mean_val_accuracy": None}, {"mean_val_accuracy": 0.75}],
        "extras": [None, None, 0.5, 3],
        "silos": {"va": {"test_accuracy": 0.8}},
    }
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]


def test_a_run_record_is_on_disk_when_written(tmp_path, monkeypatch):
    """run.json and result.json must survive a power cut whole: the file is synced before it
    is renamed into place, and its directory after (a plain rename may reach the disk first)."""
    from silo_pfl import durable

    synced: list[str] = []
    real = durable.os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(durable.os, "fsync", fsync)
    write_json_atomic(tmp_path / "run.json", {"run_id": "r"})
    assert len(synced) == 2 and synced[1] == str(tmp_path)
    assert synced[0].startswith(str(tmp_path / ".run.json."))
    assert json.loads((tmp_path / "run.json").read_text()) == {"run_id": "r"}


def test_a_file_written_again_keeps_its_permissions_and_a_new_one_is_private(tmp_path):
    """A report rewritten in place (compare's docs/RESULTS.md and its JSON, a run's record)
    became 0600 whatever it was, unreadable to the others who read it before."""
    shared, fresh = tmp_path / "shared.json", tmp_path / "fresh.json"
    write_json_atomic(shared, {"a": 1})
    os.chmod(shared, 0o644)
    write_json_atomic(shared, {"a": 2})
    write_json_atomic(fresh, {"a": 3})
    assert json.loads(shared.read_text()) == {"a": 2}
    assert (shared.stat().st_mode & 0o777, fresh.stat().st_mode & 0o777) == (0o644, 0o600)
