"""A run on a Ray this process had already started (the Python API in a notebook, the test
suite) stops on SIGTERM as a run on its own Ray does: interrupted, resumable, not a bare exit."""

from __future__ import annotations

import os
import signal

import pytest

from silo_pfl.callbacks import Callback
from silo_pfl.config import RayConfig
from silo_pfl.errors import Interrupted
from silo_pfl.federation import Federation
from silo_pfl.runtime.session import ray_session
from silo_pfl.stop_signals import sigterm_interrupts


class SigtermInRound2(Callback):
    """Sends this process SIGTERM as round 2 starts."""

    def on_round_start(self, round_: int) -> None:
        if round_ == 2:
            os.kill(os.getpid(), signal.SIGTERM)
            signal.sigtimedwait([], 1)  # let the handler run


def test_a_sigterm_stops_a_run_on_an_initialised_ray_as_an_interruption(job, ray_local):
    previous = signal.getsignal(signal.SIGTERM)  # Ray's own, from the session's ray.init
    cfg = job("jobs/heart_disease.yaml", "rounds=3", "tracking.enabled=false")
    raised: BaseException | None = None
    try:
        Federation(cfg, callbacks=[SigtermInRound2()]).run()
    except BaseException as exc:  # SystemExit(15) where Ray's handler was left in force
        raised = exc
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert isinstance(raised, Interrupted), repr(raised)
    assert raised.signum == signal.SIGTERM
    assert raised.run_id is not None and raised.round == 1


def test_a_session_inside_another_leaves_the_sigterm_handler_to_the_outer_one(ray_local):
    """`silo-pfl run`'s session holds the one a run opens on it: after a SIGTERM, the outer
    one's clean-up still ignores a second SIGTERM."""
    previous = signal.getsignal(signal.SIGTERM)
    try:
        with sigterm_interrupts():
            with pytest.raises(Interrupted), ray_session(RayConfig()):
                os.kill(os.getpid(), signal.SIGTERM)
                signal.sigtimedwait([], 1)  # let the handler run
            assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert signal.getsignal(signal.SIGTERM) is previous
