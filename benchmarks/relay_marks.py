"""A plugin for `benchmarks/relay.py` (config `plugins: [relay_marks]`): FedAvg that notes, in
`<marker_dir>/<pid>`, the wall time at which each silo's training of a round ends (`after_fit`)
and at which its evaluation of the round begins (`personalized_model`)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from silo_pfl.algorithms import register
from silo_pfl.algorithms.base import SiloTrainer
from silo_pfl.algorithms.fedavg import FedAvg


@dataclass
class MarkParams:
    """Where the notes go."""

    marker_dir: str = ""


@register
class FedAvgMarked(FedAvg):
    """FedAvg whose fits and evaluations note when they end and begin."""

    name = "fedavg_marked"
    Params = MarkParams

    def after_fit(self, silo: SiloTrainer, reference: dict[str, torch.Tensor], round_: int) -> None:
        super().after_fit(silo, reference, round_)
        self._note("fit_end", round_)

    def personalized_model(self, silo: SiloTrainer, round_: int) -> nn.Module:
        self._note("eval_start", round_)
        return super().personalized_model(silo, round_)

    def _note(self, what: str, round_: int) -> None:
        with open(Path(self.params.marker_dir) / str(os.getpid()), "a") as notes:
            notes.write(f"{what} {round_} {time.time():.6f}\n")
