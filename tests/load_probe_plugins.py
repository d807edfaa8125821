"""A plugin for tests/test_zero_copy.py (config `plugins: [tests.load_probe_plugins]`): FedAvg
that counts its fits that began with the model's global keys as its last evaluation left them,
not copied in again (`held_loads` in the selected model's figures)."""

from __future__ import annotations

from typing import Any

from silo_pfl.algorithms import register
from silo_pfl.algorithms.base import SiloTrainer
from silo_pfl.algorithms.fedavg import FedAvg


def _written(silo: Any) -> dict[str, tuple[int, int]]:
    """Each global key's tensor in the silo's model: its memory and count of in-place writes."""
    model = silo.model.state_dict(keep_vars=True)
    return {key: (model[key].data_ptr(), model[key]._version) for key in silo.split.global_keys}


@register
class CountHeldLoads(FedAvg):
    """FedAvg that counts the fits whose global keys were not written since its evaluation."""

    name = "count_held_loads"

    def personalized_model(self, silo: SiloTrainer, round_: int) -> Any:
        self._evaluated = _written(silo)
        return super().personalized_model(silo, round_)

    def begin_round(self, silo: SiloTrainer, reference, broadcast) -> None:
        super().begin_round(silo, reference, broadcast)
        held = getattr(self, "_evaluated", None) == _written(silo)
        self._held = getattr(self, "_held", 0) + int(held)

    def report(self) -> dict[str, float]:
        return {"held_loads": float(getattr(self, "_held", 0))}
