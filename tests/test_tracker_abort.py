"""MlflowTracker.abort, the clean-up of a run that failed or was interrupted: it marks the runs
KILLED or FAILED and the silos' logged models FAILED. A store that has died is waited on once
(MLflow gives up on a call after its retries, about 7 s: silo_pfl.tracking's settings), not
once per silo; a store that answers one call with an error still gets the others.

Without Ray: the tracker is driven as the orchestrator does, over a real `mlflow server` (the
CLI, in a process of its own, stopped to play a store that dies) or a real SQLite store."""

from __future__ import annotations

import os
import signal
import sqlite3
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from mlflow import MlflowClient
from processes import mlflow_server as start_mlflow_server
from processes import stop_group
from serving import free_port

from silo_pfl.config import FederationConfig
from silo_pfl.errors import Interrupted
from silo_pfl.messages import SiloInfo, SplitInfo
from silo_pfl.results import RoundSummary
from silo_pfl.settings import load_config
from silo_pfl.stop_signals import sigterm_interrupts
from silo_pfl.tracking.tracker import MlflowTracker

SILOS = 6
SPLIT = SplitInfo(10, 5, 40)


@pytest.fixture
def mlflow_server(tmp_path):
    """A real `mlflow server` on a free port; the test stops it, and the teardown makes sure."""
    port = free_port()
    with start_mlflow_server(tmp_path, port) as server:
        yield SimpleNamespace(uri=f"http://127.0.0.1:{port}", proc=server)


def _config(tmp_path: Path, uri: str) -> FederationConfig:
    overrides = [f"output_dir={tmp_path / 'runs'}", f"data.num_silos={SILOS}", "rounds=2"]
    overrides += [f"tracking.uri={uri}", "tracking.report=false", "privacy.central_models=full"]
    return load_config("jobs/digits_dirichlet.yaml", overrides)


def _started(cfg: FederationConfig, buffered: bool = False) -> MlflowTracker:
    """A tracker past on_start and the exporters (a logged model per silo) and round 1, whose
    figures are still `buffered` (not yet flushed), or written."""
    infos = [SiloInfo(f"silo_{i}", 100, 20, 30, (64,), 10, columns="c") for i in range(SILOS)]
    tracker = MlflowTracker(cfg)
    tracker.on_start(cfg, infos, SPLIT)
    tracker.exporters(infos)
    figures = {"train_loss": 0.5, "val_accuracy": 0.7, "test_accuracy": 0.7}
    summary = RoundSummary(
        round=1,
        seconds=0.1,
        mean_train_loss=0.5,
        mean_val_accuracy=0.7,
        mean_test_accuracy=0.7,
        silos={info.silo: dict(figures) for info in infos},
        participants=[info.silo for info in infos],
    )
    tracker.flushed_at = time.monotonic()  # the round's figures wait in the buffer
    tracker.on_round_end(summary)
    if not buffered:
        tracker._flush()
    return tracker


def test_an_abort_over_a_dead_store_waits_on_it_once(tmp_path, mlflow_server):
    """Before, each silo's logged model was finalized on its own, each call retried for about
    7 s: with 6 silos the abort took about 50 s (84 s with 10)."""
    tracker = _started(_config(tmp_path, mlflow_server.uri))
    assert len(tracker.logged) == SILOS
    stop_group(mlflow_server.proc)
    began = time.monotonic()
    tracker.abort(killed=True)  # never raises
    took = time.monotonic() - began
    assert took < 20, f"abort took {took:.1f} s over a dead store"
    assert tracker.unreachable
    began = time.monotonic()
    tracker.abort()  # a second clean-up leaves the dead store alone at once
    assert time.monotonic() - began < 1


def _statuses(client: MlflowClient, tracker: MlflowTracker) -> dict[str, Any]:
    runs = [tracker.run_id, *tracker.children.values()]
    return {run_id: client.get_run(run_id).info.status for run_id in runs}


def test_an_abort_over_a_store_that_answers_marks_every_run_and_model(tmp_path):
    """A store that answers calls with an error (a silo's run deleted by hand: its buffered
    figures and its status are refused) is not taken for a dead one: every other run is still
    marked KILLED, every logged model FAILED."""
    tracker = _started(_config(tmp_path, f"sqlite:///{tmp_path / 'mlflow.db'}"), buffered=True)
    assert tracker.buffered  # the abort's flush goes first, and fails on the deleted run
    client = MlflowClient(tracker.uri)
    gone = tracker.children["silo_0"]
    client.delete_run(gone)
    models = [logged.model_id for logged in tracker.logged.values()]
    tracker.abort(killed=True)
    assert not tracker.unreachable
    statuses = _statuses(client, tracker)
    assert {s for run_id, s in statuses.items() if run_id != gone} == {"KILLED"}, statuses
    assert {str(client.get_logged_model(m).status) for m in models} == {"FAILED"}


def test_a_sigterm_in_the_middle_of_a_write_leaves_the_store_to_the_clean_up(tmp_path):
    """SIGTERM raised inside MLflow's SQLAlchemy code, half-way through a batch, left that
    session's connection holding SQLite's write lock while the interruption lived, as it does
    in Federation.run's clean-up: the abort then waited out the busy timeout (20 s) and marked
    nothing KILLED (CI: `ray job stop` at round 5 took over 30 s). The write now finishes first,
    and the interruption follows it."""
    tracker = _started(_config(tmp_path, f"sqlite:///{tmp_path / 'mlflow.db'}"), buffered=True)
    listener = _listening("after_cursor_execute", _signal_at("INSERT INTO metrics", signal.SIGTERM))
    try:
        with sigterm_interrupts(), pytest.raises(Interrupted) as stopped:
            tracker._flush()
    finally:
        _stop_listening("after_cursor_execute", listener)
    assert stopped.value.signum == signal.SIGTERM  # the interruption still lives
    began = time.monotonic()
    tracker.abort(killed=True)
    took = time.monotonic() - began
    assert took < 10, f"the abort took {took:.1f} s"
    assert not tracker.unreachable
    client = MlflowClient(tracker.uri)
    assert set(_statuses(client, tracker).values()) == {"KILLED"}
    for child in tracker.children.values():  # the interrupted batch went in whole, once
        assert [m.step for m in client.get_metric_history(child, "val_accuracy")] == [1]


def test_an_abort_over_a_database_another_process_keeps_locked_waits_on_it_once(tmp_path):
    """A SQLite store whose write lock another connection holds answers each call after its
    busy timeout, 20 s, with TEMPORARILY_UNAVAILABLE: taken for an answer, the abort waited
    once per run and model (14 calls, 280 s here)."""
    tracker = _started(_config(tmp_path, f"sqlite:///{tmp_path / 'mlflow.db'}"))
    holder = sqlite3.connect(tmp_path / "mlflow.db", isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        began = time.monotonic()
        tracker.abort(killed=True)
        took = time.monotonic() - began
    finally:
        holder.rollback()
        holder.close()
    assert took < 60, f"abort took {took:.1f} s over a locked store"
    assert tracker.unreachable


def test_a_resume_marks_failed_the_models_a_killed_attempt_left_pending(tmp_path):
    """SIGKILL (or an OOM kill) skips the abort: the attempt's logged models stayed PENDING in
    the store's list for good, beside the ones the resume made."""
    cfg = _config(tmp_path, f"sqlite:///{tmp_path / 'mlflow.db'}")
    killed = _started(cfg)  # then killed: no abort
    orphans = [logged.model_id for logged in killed.logged.values()]
    infos = [SiloInfo(f"silo_{i}", 100, 20, 30, (64,), 10, columns="c") for i in range(SILOS)]
    resumed = MlflowTracker(cfg)
    resumed.restore(killed.state())
    resumed.on_start(cfg, infos, SPLIT)
    resumed.exporters(infos)
    client = MlflowClient(resumed.uri)
    assert {str(client.get_logged_model(m).status) for m in orphans} == {"FAILED"}
    fresh = [logged.model_id for logged in resumed.logged.values()]
    assert {str(client.get_logged_model(m).status) for m in fresh} == {"PENDING"}


def test_an_abort_as_a_new_store_opens_waits_for_its_tables(tmp_path):
    """A run stopped in its first seconds on a new SQLite store: the abort returned at once
    (no run yet), the process ended, and with it the thread half-way through making MLflow's
    tables, which left a store no later run could open ("table trace_info already exists")."""
    tracker = MlflowTracker(_config(tmp_path, f"sqlite:///{tmp_path / 'mlflow.db'}"))
    tracker.abort(killed=True)
    assert tracker.opening.done()
    assert tracker.opening.exception() is None


def _signal_at(statement: str, signum: int, nth: int = 1) -> Any:
    """A SQLAlchemy listener (of after_cursor_execute: the write made, its lock held) that
    sends `signum` to this process as the `nth` statement starting with `statement` has run."""
    seen: list[str] = []

    def send(conn: Any, cursor: Any, text: str, *rest: Any) -> None:
        if text.startswith(statement):
            seen.append(text)
            if len(seen) == nth:
                os.kill(os.getpid(), signum)

    return send


def _listening(event_name: str, listener: Any) -> Any:
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    event.listen(Engine, event_name, listener)
    return listener


def _stop_listening(event_name: str, listener: Any) -> None:
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    event.remove(Engine, event_name, listener)


def test_a_second_ctrl_c_during_the_abort_leaves_no_run_running(tmp_path):
    """Ctrl-C pressed twice: the second, during the clean-up's first status update, raised out
    of the abort and left every other run RUNNING for good."""
    tracker = _started(_config(tmp_path, f"sqlite:///{tmp_path / 'mlflow.db'}"))
    listener = _listening("after_cursor_execute", _signal_at("UPDATE runs", signal.SIGINT))
    try:
        tracker.abort(killed=True)
    finally:
        _stop_listening("after_cursor_execute", listener)
    client = MlflowClient(tracker.uri)
    assert set(_statuses(client, tracker).values()) == {"KILLED"}


def test_a_sigterm_as_a_silos_run_is_made_leaves_no_run_unrecorded(tmp_path):
    """The signal took effect as create_run returned, before the run was recorded: the abort
    never learnt of it, and it stayed RUNNING."""
    cfg = _config(tmp_path, f"sqlite:///{tmp_path / 'mlflow.db'}")
    infos = [SiloInfo(f"silo_{i}", 100, 20, 30, (64,), 10, columns="c") for i in range(SILOS)]
    tracker = MlflowTracker(cfg)
    listener = _signal_at("INSERT INTO runs", signal.SIGTERM, nth=3)
    _listening("after_cursor_execute", listener)
    try:
        with sigterm_interrupts(), pytest.raises(Interrupted):
            tracker.on_start(cfg, infos, SPLIT)
    finally:
        _stop_listening("after_cursor_execute", listener)
    tracker.abort(killed=True)
    client = MlflowClient(tracker.uri)
    made = client.search_runs([tracker.experiment_id])
    assert len(made) == 3 and {run.info.status for run in made} == {"KILLED"}


def test_an_abort_never_waits_on_a_network_database_still_opening(tmp_path):
    """Only a SQLite file's tables are made locally, in seconds: an abort that waited on any
    database's opening, with signals held, hung for good on a PostgreSQL host that accepts and
    never answers (psycopg2 has no connect timeout), Ctrl-C and SIGTERM dropped."""
    from concurrent.futures import Future

    tracker = MlflowTracker(_config(tmp_path, "postgresql://u:p@127.0.0.1:1/db"))
    tracker.opening.exception()  # here it fails at once (no driver installed)
    tracker.opening = Future()  # as the opening psycopg2 never ends
    began = time.monotonic()
    tracker.abort(killed=True)
    assert time.monotonic() - began < 5


def test_a_sqlite_stores_client_can_be_copied(tmp_path):
    """Its wrapper looked up `_client` through itself before it was set: copy and unpickle
    recursed until Python gave up."""
    import copy

    from silo_pfl.tracking.store import open_client

    client = open_client(f"sqlite:///{tmp_path / 'mlflow.db'}", "tracking.uri")
    assert copy.copy(client).search_experiments(max_results=1) is not None
