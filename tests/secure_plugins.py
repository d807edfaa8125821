"""A plugin for the secure-aggregation fault tests (config `plugins: [tests.secure_plugins]`):
FedPer whose named silos' processes die at a chosen step of a secure round, and which records
every silo's plain update, so that a test can check the unmasked sum against it."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from silo_pfl.algorithms import register
from silo_pfl.algorithms.base import SiloTrainer
from silo_pfl.algorithms.fedper import FedPer, FedPerParams


@dataclass
class DropParams(FedPerParams):
    """Who dies, in which round, at which step; and where updates are recorded."""

    silos: list[str] = field(default_factory=list)
    round: int = 2
    step: str = "after_masking"  # after_masking: before it reveals; before_masking: in its fit
    record: str = ""  # a directory: <round>-<silo>.npz holds its delta and weight


def _die(*_: object) -> None:
    os._exit(1)


@register
class DropAt(FedPer):
    """FedPer, except that `silos` die in round `round` at `step`."""

    name = "drop_at"
    Params = DropParams

    def after_fit(self, silo: SiloTrainer, reference: dict[str, torch.Tensor], round_: int) -> None:
        super().after_fit(silo, reference, round_)
        name = getattr(silo, "name", "")
        if self.params.record:
            state = silo.model.state_dict()
            delta = {k: (state[k] - reference[k]).numpy() for k in silo.split.global_keys}
            weight = np.array(len(silo.train_xy[1]))
            np.savez(Path(self.params.record) / f"{round_}-{name}.npz", weight=weight, **delta)
        if name in self.params.silos and round_ == self.params.round:
            if self.params.step == "before_masking":
                _die()
            silo.unmask = _die  # it sends its masked vector, then dies when asked to reveal
