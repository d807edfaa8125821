"""A plugin for tests/test_round_pipeline.py (config `plugins: [tests.fit_markers]`): FedAvg
whose every fit, as it begins, creates the file `<marker_dir>/fit-<round>-<silo>`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from silo_pfl.algorithms import register
from silo_pfl.algorithms.base import SiloTrainer
from silo_pfl.algorithms.fedavg import FedAvg


@dataclass
class MarkParams:
    """Where the markers go."""

    marker_dir: str = ""


@register
class MarkFits(FedAvg):
    """FedAvg that marks the start of each of its fits."""

    name = "mark_fits"
    Params = MarkParams

    def begin_round(self, silo: SiloTrainer, reference, broadcast) -> None:
        super().begin_round(silo, reference, broadcast)
        round_ = getattr(silo, "committed", 0) + 1
        name = getattr(silo, "name", "")
        (Path(self.params.marker_dir) / f"fit-{round_}-{name}").touch()
