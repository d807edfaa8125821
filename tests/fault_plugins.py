"""A plugin for the fault tests (config `plugins: [fault_plugins]`): FedPer whose one silo's
training turns to NaN in one round, as a silo with corrupt data or a bad update would, whose fit
raises in one round, or whose process dies or stops in the middle of its training in one round;
and SCAFFOLD whose one silo dies as it evaluates a round its update was aggregated in. The faults
strike from inside the silo's own calls, so they land there however fast the machine is."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from silo_pfl.algorithms import register
from silo_pfl.algorithms.base import SiloTrainer
from silo_pfl.algorithms.fedper import FedPer, FedPerParams
from silo_pfl.algorithms.scaffold import Scaffold


@dataclass
class OnceParams(FedPerParams):
    """Which silo the fault hits, and in which round."""

    silo: str = ""
    round: int = 3


def strikes_now(params: OnceParams, silo: SiloTrainer) -> bool:
    """Whether `silo` is the one `params` names, in the round it names (its fit of the round
    after its last commit)."""
    due = getattr(silo, "committed", 0) + 1 == params.round
    return due and getattr(silo, "name", "") == params.silo


@register
class NanOnce(FedPer):
    """FedPer, except that `silo`'s loss is NaN in round `round` (and only then)."""

    name = "nan_once"
    Params = OnceParams

    def __init__(self, params: OnceParams, train) -> None:
        super().__init__(params, train)
        self.poison = False

    def after_fit(self, silo: SiloTrainer, reference: dict[str, torch.Tensor], round_: int) -> None:
        super().after_fit(silo, reference, round_)
        self.poison = (
            getattr(silo, "name", "") == self.params.silo and round_ + 1 == self.params.round
        )

    def extra_loss(
        self, model: nn.Module, reference: dict[str, torch.Tensor]
    ) -> torch.Tensor | None:
        if not self.poison:
            return super().extra_loss(model, reference)
        self.poison = False  # one batch is enough: its NaN gradients reach every weight
        return float("nan") * sum(param.sum() for param in model.parameters())


@dataclass
class SignalParams(OnceParams):
    """`marker`: a file that the fault creates as it strikes; it strikes only while the file is
    absent (so once, even across the restart of the process it killed)."""

    marker: str = ""


@register
class RaiseOnce(FedPer):
    """FedPer, except that `silo`'s fit raises in round `round` (a bug, a full disk); with a
    `marker`, only while that file is absent (once, across a resume too)."""

    name = "raise_once"
    Params = SignalParams

    def __init__(self, params: SignalParams, train) -> None:
        super().__init__(params, train)
        self.raised = False

    def begin_round(self, silo: SiloTrainer, reference, broadcast) -> None:
        super().begin_round(silo, reference, broadcast)
        marker = Path(self.params.marker) if self.params.marker else None
        if strikes_now(self.params, silo) and not self.raised:
            if marker is not None and marker.exists():
                return
            self.raised = True
            if marker is not None:
                marker.touch()
            raise RuntimeError("disk full")


# A fit sent ahead starts as soon as the silo's commit returns, while the commit's answer may
# still be on its way to the driver: a process killed or stopped in that instant loses it, and
# the driver counts the commit as failed. The fault waits this long first, so that it strikes
# the fit, as the tests mean, and not the previous round's commit.
ANSWER_SENT_S = 0.5


class SignalOnce(FedPer):
    """FedPer, except that `silo`'s process sends itself `sig` in the middle of its training in
    round `round` (at its first batch's loss, `ANSWER_SENT_S` after the fit began), once."""

    Params = SignalParams
    sig: signal.Signals

    def __init__(self, params: SignalParams, train) -> None:
        super().__init__(params, train)
        if not params.marker:
            raise ValueError(f"algorithm.{self.name}.marker: a file path is required")
        self.armed = False

    def begin_round(self, silo: SiloTrainer, reference, broadcast) -> None:
        super().begin_round(silo, reference, broadcast)
        self.armed = strikes_now(self.params, silo) and not Path(self.params.marker).exists()

    def extra_loss(
        self, model: nn.Module, reference: dict[str, torch.Tensor]
    ) -> torch.Tensor | None:
        if self.armed:
            self.armed = False
            time.sleep(ANSWER_SENT_S)
            Path(self.params.marker).write_text(str(os.getpid()))
            os.kill(os.getpid(), self.sig)
        return super().extra_loss(model, reference)


@register
class DieOnce(SignalOnce):
    """`silo`'s process is killed (SIGKILL) mid-fit in round `round`: it and any silo packed
    with it restart from their last commit."""

    name = "die_once"
    sig = signal.SIGKILL


@register
class StopOnce(SignalOnce):
    """`silo`'s process stops (SIGSTOP) mid-fit in round `round`, until someone sends it
    SIGCONT (the pid is in `marker`)."""

    name = "stop_once"
    sig = signal.SIGSTOP


@register
class ShiftOnce(FedPer):
    """FedPer, except that `silo` starts round `round` from its global weights shifted by 10,
    once: a finite update far over a sane aggregation.max_update_norm, which the server rejects."""

    name = "shift_once"
    Params = OnceParams

    def __init__(self, params: OnceParams, train) -> None:
        super().__init__(params, train)
        self.shifted = False

    def begin_round(self, silo: SiloTrainer, reference, broadcast) -> None:
        super().begin_round(silo, reference, broadcast)
        if strikes_now(self.params, silo) and not self.shifted:
            self.shifted = True
            with torch.no_grad():
                for name, param in silo.model.named_parameters():
                    if name in reference:
                        param.add_(10.0)


@dataclass
class SlowParams(FedPerParams):
    """Every silo's fits sleep `seconds` in rounds 1 to `until`; its model build (set-up)
    sleeps `build_s`, and each run of its local procedure (a fit's, a joining silo's adapt)
    `phases_s`."""

    seconds: float = 1.0
    until: int = 5
    build_s: float = 0.0
    phases_s: float = 0.0


@register
class SlowRounds(FedPer):
    """FedPer whose early rounds, or steps, are slow: a run whose parts take a known least
    time."""

    name = "slow_rounds"
    Params = SlowParams

    def begin_round(self, silo: SiloTrainer, reference, broadcast) -> None:
        super().begin_round(silo, reference, broadcast)
        if getattr(silo, "committed", 0) < self.params.until:
            time.sleep(self.params.seconds)

    def check_batches(self, silo: str, rows: int, per_epoch: int) -> None:
        time.sleep(self.params.build_s)
        super().check_batches(silo, rows, per_epoch)

    def phases(self):
        time.sleep(self.params.phases_s)
        return super().phases()


@dataclass
class ScaffoldSignalParams:
    """As SignalParams, for SCAFFOLD (which takes no parameters of its own)."""

    silo: str = ""
    round: int = 3
    marker: str = ""


@register
class ScaffoldDiesInEvaluation(Scaffold):
    """SCAFFOLD, except that `silo`'s process is killed (SIGKILL) as it evaluates round `round`:
    after its update was aggregated, before it commits the round; once (while `marker` is
    absent)."""

    name = "scaffold_dies_in_evaluation"
    Params = ScaffoldSignalParams

    def personalized_model(self, silo: SiloTrainer, round_: int) -> nn.Module:
        params = self.params
        if silo.name == params.silo and round_ == params.round:
            marker = Path(params.marker)
            if not marker.exists():
                marker.write_text(str(os.getpid()))
                os.kill(os.getpid(), signal.SIGKILL)
        return super().personalized_model(silo, round_)


@dataclass
class SlowEvaluationParams(FedPerParams):
    """`silo`'s evaluations sleep `seconds` in rounds `first` to `last`."""

    silo: str = ""
    first: int = 2
    last: int = 5
    seconds: float = 2.0


@register
class SlowEvaluation(FedPer):
    """FedPer whose one silo evaluates slowly in some rounds: its update is aggregated in time,
    and it commits each such round on its disk after the round's deadline has passed."""

    name = "slow_evaluation"
    Params = SlowEvaluationParams

    def personalized_model(self, silo: SiloTrainer, round_: int) -> nn.Module:
        params = self.params
        if silo.name == params.silo and params.first <= round_ <= params.last:
            time.sleep(params.seconds)
        return super().personalized_model(silo, round_)
