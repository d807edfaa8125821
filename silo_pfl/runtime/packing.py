"""Which silos share a worker process: `ray.silos_per_worker`.

Under `ray.placement=per_node`, or `auto` with silos pinned to nodes, every silo has its own
worker, on its own node. Otherwise silos that may run on the same nodes (the same node label,
or none) are dealt in order into groups of k: `silos_per_worker=k`, or under `auto` as few
workers as the Ray instance has CPUs (one worker per core), so a simulation of many silos on one
machine imports torch once per core rather than once per silo.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from silo_pfl.config import FederationConfig
from silo_pfl.runtime.placement import silo_selector


def per_worker(cfg: FederationConfig, num_silos: int, cpus: float, pinned: bool = False) -> int:
    """How many of `num_silos` silos share a worker, at most; `pinned` silos need a labelled
    node."""
    chosen = cfg.ray.silos_per_worker
    if cfg.ray.placement == "per_node" or (pinned and chosen == "auto"):
        return 1
    if chosen == "auto":
        return max(1, math.ceil(num_silos / max(1, int(cpus))))
    return int(chosen)


def pack(cfg: FederationConfig, names: Sequence[str], cpus: float) -> list[list[str]]:
    """The silos of each worker: silos with the same node selector, dealt in order so that
    the groups differ in size by one at most."""
    by_selector: dict[tuple[tuple[str, str], ...], list[str]] = {}
    for name in names:
        selector = silo_selector(cfg, name) or {}
        by_selector.setdefault(tuple(sorted(selector.items())), []).append(name)
    groups: list[list[str]] = []
    for selector, members in by_selector.items():
        k = per_worker(cfg, len(members), cpus, pinned=bool(selector))
        workers = math.ceil(len(members) / k)
        groups.extend(members[i::workers] for i in range(workers))
    return groups
