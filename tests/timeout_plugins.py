"""A plugin for tests/test_packing_timeouts.py (config `plugins: [tests.timeout_plugins]`):
FedPer whose silos' model builds and local procedures sleep a known time."""

from __future__ import annotations

import time
from dataclasses import dataclass

from silo_pfl.algorithms import register
from silo_pfl.algorithms.fedper import FedPer, FedPerParams


@dataclass
class SlowStepsParams(FedPerParams):
    """How long each silo's model build (set-up) and each local procedure sleep."""

    build_s: float = 0.0
    phases_s: float = 0.0


@register
class SlowSteps(FedPer):
    """FedPer whose silos' builds sleep `build_s` and local procedures `phases_s`."""

    name = "slow_steps"
    Params = SlowStepsParams

    def check_batches(self, silo: str, rows: int, per_epoch: int) -> None:
        time.sleep(self.params.build_s)
        super().check_batches(silo, rows, per_epoch)

    def phases(self):
        time.sleep(self.params.phases_s)
        return super().phases()
