"""Handing the callbacks' exporters to silos, and running them at the end: one path for a
federation run and a silo's onboarding alike."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from silo_pfl.callbacks import Callback
from silo_pfl.errors import FederationError
from silo_pfl.messages import SiloInfo
from silo_pfl.runtime.actors import get


def attach_exporters(
    callbacks: Sequence[Callback], infos: Sequence[SiloInfo], actors: dict[str, Any], timeout: float
) -> dict[str, dict[str, Any]]:
    """Hand each callback's per-silo exporters to their silos, which check them now."""
    per_silo: dict[str, dict[str, Any]] = {}
    for index, callback in enumerate(callbacks):
        for silo, exporter in callback.exporters(infos).items():
            if silo not in {info.silo for info in infos}:
                raise FederationError(
                    f"{type(callback).__name__}: an exporter for {silo!r}, not a silo here"
                )
            per_silo.setdefault(silo, {})[str(index)] = exporter
    refs = [actors[s].attach.remote(e) for s, e in per_silo.items()]
    get(refs, "silo exporter check", timeout, [f"silo {s}" for s in per_silo])
    return per_silo


def export(
    callbacks: Sequence[Callback], silos: Sequence[str], actors: dict[str, Any], timeout: float
) -> None:
    """Each silo runs its exporters in its own process; receipts go back to their callbacks."""
    refs = [actors[s].export.remote() for s in silos]
    done = get(refs, "silo export", timeout, [f"silo {s}" for s in silos])
    receipts = dict(zip(list(silos), done, strict=True))
    for index, callback in enumerate(callbacks):
        mine = {s: r[str(index)] for s, r in receipts.items() if str(index) in r}
        if mine:
            callback.on_exported(mine)
