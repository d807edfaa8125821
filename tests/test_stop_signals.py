"""SIGTERM as Ctrl-C: the signal a run names when it stops is the one it got, even where Ray
turned the interrupted wait into a plain KeyboardInterrupt (real signals, to this process)."""

from __future__ import annotations

import os
import signal

import pytest

from silo_pfl.errors import Interrupted
from silo_pfl.stop_signals import cause, sigterm_interrupts


def test_a_plain_keyboard_interrupt_after_a_sigterm_is_the_sigterm():
    with sigterm_interrupts():
        assert cause(KeyboardInterrupt()) == signal.SIGINT  # Ctrl-C's, when no SIGTERM came
        with pytest.raises(Interrupted):
            os.kill(os.getpid(), signal.SIGTERM)
            signal.sigtimedwait([], 1)  # let the handler run
        # Ray raises its own KeyboardInterrupt out of an interrupted wait: still SIGTERM's.
        assert cause(KeyboardInterrupt()) == signal.SIGTERM
        assert cause(Interrupted(signal.SIGINT)) == signal.SIGINT
    with sigterm_interrupts():
        assert cause(KeyboardInterrupt()) == signal.SIGINT, "a new run starts afresh"
