"""The run's history is logged a round at a time on the server's node (`round_log`): each server
checkpoint carries the driver's bookkeeping and this round's summary only, and resume reads the
history back from the log, cut to the checkpoint's round."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from old_checkpoints import save_torch_kind
from plain_federation import federation, play_round

from silo_pfl import checkpoint
from silo_pfl.config import to_dict
from silo_pfl.results import RoundSummary
from silo_pfl.round_log import RoundLog
from silo_pfl.server_start import new_server

HOSPITALS = ("cleveland", "hungarian", "switzerland", "va")


def _summary(round_: int) -> dict:
    """A round's summary as the driver sends it, with a NaN where no silo had a loss."""
    return dataclasses.asdict(
        RoundSummary(
            round=round_,
            seconds=0.1 * round_,
            mean_train_loss=math.nan,
            mean_val_accuracy=0.5 + round_ / 100,
            mean_test_accuracy=1 / 3,
            silos={"va": {"val_accuracy": 0.25, "test_accuracy": 2 / 3}},
            participants=["va"],
            absent={"cleveland": "its process died (RayActorError)"},
            attempts=2,
            restarted={"va": {"round": round_ - 1, "local_digest": "ab", "pid": 7}},
        )
    )


def _same(a: list[dict], b: list[dict]) -> bool:
    """Equal, reading NaN as equal to NaN."""
    return repr(a) == repr(b)


def test_a_server_checkpoint_holds_one_summary_a_round_and_resume_reads_them_all(job, tmp_path):
    silos, server = federation(job, "fedavg", f"output_dir={tmp_path}", silos=HOSPITALS)
    server.checkpoint(0, {"summary": None, "selector": {}})
    for round_ in (1, 2, 3):
        play_round(silos, server, round_, commit=True)
        server.checkpoint(round_, {"summary": _summary(round_), "selector": {"*": [0.5, -1.0]}})
    saved = checkpoint.load(server.dir, 3)
    assert saved["driver"] == {"selector": {"*": [0.5, -1.0]}}, "no history in the checkpoint"
    assert saved["logged"] == 3
    resumed = new_server(to_dict(server.cfg), (13,), 2)
    driver = resumed.resume()
    assert driver["selector"] == {"*": [0.5, -1.0]}
    assert _same(driver["history"], [_summary(r) for r in (1, 2, 3)])
    assert [RoundSummary(**s).round for s in driver["history"]] == [1, 2, 3]


def test_resume_cuts_off_a_round_logged_after_the_last_good_checkpoint(job, tmp_path):
    """A crash between the log's append and the checkpoint leaves a line (or part of one) that
    no checkpoint covers: resume drops it, and the next round is logged in its place."""
    silos, server = federation(job, "fedavg", f"output_dir={tmp_path}", silos=HOSPITALS)
    for round_ in (1, 2):
        play_round(silos, server, round_, commit=True)
        server.checkpoint(round_, {"summary": _summary(round_)})
    server.history.append(3, _summary(3))  # the crash came before checkpoint 3
    with server.history.path.open("ab") as log:
        log.write(b'{"round": 4, "summ')
    resumed = new_server(to_dict(server.cfg), (13,), 2)
    assert [s["round"] for s in resumed.resume()["history"]] == [1, 2]
    for silo in silos:
        silo.restore(2)
    play_round(silos, resumed, 3, commit=True)
    again = _summary(3) | {"seconds": 9.0}
    resumed.checkpoint(3, {"summary": again})
    assert RoundLog(resumed.dir).read(3)[-1]["seconds"] == 9.0


def test_a_resume_that_walks_back_then_stops_leaves_the_log_for_the_next_resume(job, tmp_path):
    """A resume looks at round 3's checkpoint, walks back to round 2 (as it does when a silo's
    commit of 3 is damaged), then the run stops before it checkpoints round 3 again. Reading
    cuts nothing off the log, so the next resume still reads round 3 in full; only the next
    append cuts what follows the rounds read. Before, the walk-back cut the log to 2 lines and
    every later resume failed: "2 rounds logged, the checkpoint needs 3"."""
    silos, server = federation(job, "fedavg", f"output_dir={tmp_path}", silos=HOSPITALS)
    server.checkpoint(0, {"summary": None})
    for round_ in (1, 2, 3):
        play_round(silos, server, round_, commit=True)
        server.checkpoint(round_, {"summary": _summary(round_)})
    server.release()
    probe = new_server(to_dict(server.cfg), (13,), 2)
    assert len(probe.resume()["history"]) == 3
    assert len(probe.resume(before=3)["history"]) == 2
    probe.release()  # stopped here
    again = new_server(to_dict(server.cfg), (13,), 2)
    assert _same(again.resume()["history"], [_summary(r) for r in (1, 2, 3)])
    again.resume(before=3)
    for silo in silos:
        silo.restore(2)
    play_round(silos, again, 3, commit=True)
    again.checkpoint(3, {"summary": _summary(3) | {"seconds": 9.0}})
    assert [s["seconds"] for s in RoundLog(again.dir).read(3)] == [0.1, 0.2, 9.0]
    assert again.history.path.read_bytes().count(b"\n") == 3


def test_a_checkpoint_whose_rounds_the_log_lost_is_skipped_for_the_one_before(job, tmp_path):
    """A power cut kept round 3's checkpoint but not its log line (one sync of the file system
    orders neither before the other): resume takes round 2, and says why."""
    silos, server = federation(job, "fedavg", f"output_dir={tmp_path}", silos=HOSPITALS)
    for round_ in (1, 2, 3):
        play_round(silos, server, round_, commit=True)
        server.checkpoint(round_, {"summary": _summary(round_)})
    server.release()
    log = server.history.path
    log.write_bytes(b"".join(log.read_bytes().splitlines(keepends=True)[:2]))
    resumed = new_server(to_dict(server.cfg), (13,), 2)
    driver = resumed.resume()
    assert [s["round"] for s in driver["history"]] == [1, 2] and resumed.round == 2
    assert driver["skipped"] == [
        f"{log}: 2 rounds logged, the checkpoint needs 3; checkpoint "
        f"{checkpoint.path_of(server.dir, 3)} skipped"
    ]


def test_a_log_missing_rounds_its_checkpoint_covers_is_a_clear_error(tmp_path):
    log = RoundLog(tmp_path)
    log.append(1, _summary(1))
    with pytest.raises(
        checkpoint.CheckpointError, match=r"1 rounds logged, the checkpoint needs 2"
    ):
        log.read(2)
    log.path.write_text('{"round": 2, "summary": {}}\n')
    with pytest.raises(checkpoint.CheckpointError, match=r"round 2 where round 1 was expected"):
        log.read(1)


def test_a_round_is_logged_only_after_the_one_before(tmp_path):
    log = RoundLog(tmp_path)
    log.append(1, _summary(1))
    with pytest.raises(RuntimeError, match="round 3 logged after 1"):
        log.append(3, _summary(3))


def test_a_checkpoint_from_before_the_log_resumes_with_its_own_history(job, tmp_path):
    """Older checkpoints carried the whole history in their driver part, and no log, and held
    torch's tensors (the server imported torch then)."""
    silos, server = federation(job, "fedavg", f"output_dir={tmp_path}", silos=HOSPITALS)
    play_round(silos, server, 1, commit=True)
    server.checkpoint(1, {"summary": _summary(1)})
    saved = checkpoint.load(server.dir, 1)
    del saved["logged"]
    saved["driver"] = {"history": [_summary(1)], "selector": {}}
    saved["global"] = {k: torch.from_numpy(v) for k, v in saved["global"].items()}
    server.history.path.unlink()
    save_torch_kind(server.dir, 1, saved)
    resumed = new_server(to_dict(server.cfg), (13,), 2)
    assert _same(resumed.resume()["history"], [_summary(1)])
    assert all(np.array_equal(resumed.state[k], v.numpy()) for k, v in saved["global"].items())
    assert _same(RoundLog(resumed.dir).read(1), [_summary(1)])
