"""Which run `--resume` takes, and which config it accepts for it."""

from __future__ import annotations

import json
import shutil

import pytest
from drivers import StopAfter

from silo_pfl.config import to_dict
from silo_pfl.errors import ConfigError
from silo_pfl.federation import Federation
from silo_pfl.run_dir import CHECKPOINTED, RESULT_FILE, RUN_FILE, RunDir, check_resumable
from silo_pfl.server_start import new_server
from silo_pfl.settings import load_config

JOB = "jobs/heart_disease.yaml"


def _checkpointed(cfg, run: RunDir) -> None:
    """Round 0 of `run` checkpointed by a real server, as a fresh run's set-up ends."""
    server = new_server(to_dict(cfg), (13,), 2, run.run_id)
    server.checkpoint(0, {"selected": {}})
    server.release()


def test_resume_passes_over_a_run_stopped_before_its_first_checkpoint(tmp_path):
    """A run killed in its set-up (SIGKILL: nothing removed its directory) holds run.json and
    nothing to resume: --resume without an id takes the latest run that checkpointed."""
    cfg = load_config(JOB, [f"output_dir={tmp_path}"])
    checkpointed = RunDir.create(cfg)
    _checkpointed(cfg, checkpointed)
    killed = RunDir.create(cfg)
    assert sorted(p.name for p in killed.path.iterdir()) == ["run.json"]
    assert RunDir.find(cfg, None).run_id == checkpointed.run_id
    assert RunDir.find(cfg, killed.run_id).run_id == killed.run_id, "named: taken as named"
    marked = RunDir.create(cfg)  # its server's directory on another node: run.json says
    marked.checkpointed()
    assert RunDir.find(cfg, None).run_id == marked.run_id
    finished = RunDir.create(cfg)
    (finished.path / RESULT_FILE).write_text("{}")
    assert RunDir.find(cfg, None).run_id == finished.run_id


def test_with_no_run_to_resume_the_newest_is_named_and_why(tmp_path):
    cfg = load_config(JOB, [f"output_dir={tmp_path}"])
    RunDir.create(cfg)
    killed = RunDir.create(cfg)
    with pytest.raises(ConfigError) as info:
        RunDir.find(cfg, None)
    assert str(info.value) == (
        f"--resume: no run of heart_disease to resume in {tmp_path}/heart_disease: the newest, "
        f"{killed.run_id}, stopped before its first checkpoint ({killed.path}/server holds no "
        "round's file on this node)"
    )


@pytest.mark.parametrize("infinite", ["aggregation.max_update_norm=.inf", "aggregation.clip=.inf"])
def test_a_run_with_an_infinite_setting_resumes_with_the_same_config(tmp_path, infinite):
    """run.json holds a value that is not finite as null (any JSON parser reads it): the
    config given on resume is compared in the same terms."""
    job = JOB
    cfg = load_config(job, [f"output_dir={tmp_path}", infinite])
    run = RunDir.create(cfg)
    check_resumable(run.saved_config(), cfg, run.path)
    key = infinite.split("=")[0]
    other = load_config(job, [f"output_dir={tmp_path}", f"{key}=5"])
    with pytest.raises(ConfigError, match=rf"^{key}: got 5\.0, but run .* started with None;"):
        check_resumable(run.saved_config(), other, run.path)
    finite = RunDir.create(other)
    with pytest.raises(ConfigError, match=rf"^{key}: got inf, but run .* started with 5\.0;"):
        check_resumable(finite.saved_config(), cfg, finite.path)


def test_a_run_marks_itself_resumable_once_round_0_is_checkpointed(tmp_path, ray_local):
    """A run stopped after round 1 is taken by --resume even where its server's directory is on
    another node than the driver's (removed here): run.json says it checkpointed."""
    cfg = load_config(JOB, [f"output_dir={tmp_path}", "rounds=3", "tracking.enabled=false"])
    with pytest.raises(KeyboardInterrupt):
        Federation(cfg, callbacks=[StopAfter(1)]).run()
    (run,) = [p.parent for p in tmp_path.glob("*/*/run.json")]
    assert json.loads((run / RUN_FILE).read_text())[CHECKPOINTED] is not None
    shutil.rmtree(run / "server")
    RunDir.create(cfg)  # a later run killed in its set-up
    assert RunDir.find(cfg, None).path == run


def test_a_run_of_an_earlier_version_is_taken_as_it_was_then(tmp_path):
    """Versions before the mark wrote no checkpointed_ns: such a run, unfinished, with its
    server's directory on another node, was passed over for an older finished run."""
    cfg = load_config(JOB, [f"output_dir={tmp_path}"])
    finished = RunDir.create(cfg)
    (finished.path / RESULT_FILE).write_text("{}")
    earlier = RunDir.create(cfg)
    record = json.loads((earlier.path / RUN_FILE).read_text())
    assert record.pop(CHECKPOINTED) is None
    (earlier.path / RUN_FILE).write_text(json.dumps(record))
    assert RunDir.find(cfg, None).run_id == earlier.run_id


def test_a_sigterm_as_a_finished_run_is_started_again_leaves_it_resumable(tmp_path, monkeypatch):
    """A finished run resumed with more rounds, stopped by SIGTERM just as its run.json took
    them: its result was still there, so the resume command the stop printed was refused
    ("already finished its 3 rounds")."""
    import os
    import signal

    from silo_pfl import run_dir
    from silo_pfl.errors import Interrupted
    from silo_pfl.stop_signals import sigterm_interrupts

    run = RunDir.create(load_config(JOB, [f"output_dir={tmp_path}", "rounds=2"]))
    (run.path / RESULT_FILE).write_text("{}")
    write = run_dir.write_json_atomic

    def then_sigterm(*args, **kwargs):
        write(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(run_dir, "write_json_atomic", then_sigterm)
    with sigterm_interrupts(), pytest.raises(Interrupted):
        run.started_again(load_config(JOB, [f"output_dir={tmp_path}", "rounds=3"]))
    assert run.saved_config()["rounds"] == 3 and not run.finished()
