"""The settings both sides of secure aggregation share, read once from the federation's config."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from silo_pfl.errors import ConfigError
from silo_pfl.secure.topology import default_threshold, graph_seed


@dataclass(frozen=True)
class SecureParams:
    """The federation, its silos (sorted), and the protocol's parameters."""

    federation: str
    silos: tuple[str, ...]
    threshold: int  # survivors needed at every step, and shares per secret under a full mesh
    neighbors: int | None = None  # SecAgg+: peers per silo; None: a full mesh
    clip: float | None = None  # bound each value to [-clip, clip] before encoding

    def __post_init__(self) -> None:
        """Checked again wherever the protocol runs, a silo's process included: a threshold that
        is no majority would let a coordinator recover both of a silo's secrets."""
        n = len(self.silos)
        if not n // 2 < self.threshold <= n:
            raise ConfigError(
                f"aggregation.secure_threshold: got {self.threshold}, expected {n // 2 + 1} to "
                f"{n} (a majority of the {n} silos)"
            )
        if self.neighbors is not None and self.neighbors < 2:
            raise ConfigError(
                f"aggregation.secure_graph.neighbors: got {self.neighbors}, expected >= 2"
            )

    @property
    def graph_seed(self) -> bytes:
        """What orders SecAgg+'s graph (`topology.graph_seed`)."""
        return graph_seed(self.federation, self.silos)

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
