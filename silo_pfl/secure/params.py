"""The settings both sides of secure aggregation share, read once from the federation's config."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from silo_pfl.secure.topology import default_threshold


@dataclass(frozen=True)
class SecureParams:
    """The federation, its silos (sorted), and the protocol's parameters."""

    federation: str
    silos: tuple[str, ...]
    threshold: int  # survivors needed at every step, and shares per secret under a full mesh
    neighbors: int | None = None  # SecAgg+: peers per silo; None: a full mesh
    clip: float | None = None  # bound each value to [-clip, clip] before encoding

    def x(self, silo: str) -> int:
        """The silo's Shamir evaluation point: its place among the federation's silos, from 1."""
        return self.silos.index(silo) + 1


def secure_params(cfg: Any, silos: Sequence[str]) -> SecureParams:
    """aggregation.* of `cfg` for the federation of `silos`."""
    agg = cfg.aggregation
    names = tuple(sorted(silos))
    return SecureParams(
        federation=cfg.name,
        silos=names,
        threshold=agg.secure_threshold or default_threshold(len(names)),
        neighbors=agg.secure_graph.neighbors,
        clip=agg.clip,
    )
