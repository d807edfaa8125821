"""A plugin for the canary test (config `plugins: [tests.canary_plugins]`): FedPer whose silos
fill every local tensor with a marker (a distinct value each round) once their update is made,
and write down the config they were given, so that the test can look for both everywhere."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from silo_pfl.algorithms import register
from silo_pfl.algorithms.base import SiloTrainer
from silo_pfl.algorithms.fedper import FedPer, FedPerParams

MARKER = 4242.4375  # round r's local tensors hold MARKER + r


@dataclass
class CanaryParams(FedPerParams):
    received: str = ""  # a directory: <silo>.json is the config that silo's process holds


@register
class Canary(FedPer):
    """FedPer, except that after each round's update every local tensor holds MARKER + round."""

    name = "canary"
    Params = CanaryParams

    def after_fit(self, silo: SiloTrainer, reference: dict[str, torch.Tensor], round_: int) -> None:
        super().after_fit(silo, reference, round_)
        state = silo.model.state_dict()
        with torch.no_grad():
            for key in silo.split.local_keys:
                if state[key].is_floating_point():
                    state[key].fill_(MARKER + round_)
        if self.params.received:
            held = json.dumps(dataclasses.asdict(silo.cfg), default=str)
            (Path(self.params.received) / f"{silo.name}.json").write_text(held)
