"""Handing the callbacks' exporters to silos, and running them at the end: one path for a
federation run and a silo's onboarding alike.

A silo's own store (silos.<name>.tracking_uri) is reached only from the silo's node, where its
`$VARS` are filled in: `check_own_stores` has each such silo check it before the run is recorded
as started (its run.json on resume, its MLflow runs), so a store the silo cannot use refuses the
run while nothing of it has changed; `attach_exporters`, after on_start, hands every exporter."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from silo_pfl.callbacks import Callback
from silo_pfl.errors import FederationError
from silo_pfl.messages import SiloInfo
from silo_pfl.runtime.actors import get_silos

if TYPE_CHECKING:
    from silo_pfl.silo import SiloExporter


def _per_silo(
    callbacks: Sequence[Callback],
    infos: Sequence[SiloInfo],
    exporters: Callable[[Callback], Mapping[str, SiloExporter]],
) -> dict[str, dict[str, Any]]:
    """Silo -> {callback's index: the exporter `exporters` gives for that silo}."""
    per_silo: dict[str, dict[str, Any]] = {}
    names = {info.silo for info in infos}
    for index, callback in enumerate(callbacks):
        for silo, exporter in exporters(callback).items():
            if silo not in names:
                raise FederationError(
                    f"{type(callback).__name__}: an exporter for {silo!r}, not a silo here"
                )
            per_silo.setdefault(silo, {})[str(index)] = exporter
    return per_silo


def _attach(per_silo: dict[str, dict[str, Any]], actors: dict[str, Any], timeout: float) -> None:
    """Each silo keeps its exporters, checking each one's store from its node now (a worker's
    calls for k silos, run one after another, are waited for k times `timeout`)."""
    refs = {s: actors[s].attach.remote(e) for s, e in per_silo.items()}
    get_silos(refs, actors, "silo exporter check", timeout)


def check_own_stores(
    callbacks: Sequence[Callback], infos: Sequence[SiloInfo], actors: dict[str, Any], timeout: float
) -> None:
    """Before on_start (and, on resume, before the run records it): each silo with a store of
    its own checks it from its node, so one it cannot use refuses the run before any record
    of it, its own or its MLflow runs', changes. attach_exporters hands the exporters after."""
    per_silo = _per_silo(callbacks, infos, lambda c: c.early_exporters(infos))
    if per_silo:
        _attach(per_silo, actors, timeout)


def attach_exporters(
    callbacks: Sequence[Callback], infos: Sequence[SiloInfo], actors: dict[str, Any], timeout: float
) -> dict[str, dict[str, Any]]:
    """Hand each callback's per-silo exporters to their silos, which check them now."""
    per_silo = _per_silo(callbacks, infos, lambda c: c.exporters(infos))
    _attach(per_silo, actors, timeout)
    return per_silo


def export(
    callbacks: Sequence[Callback], silos: Sequence[str], actors: dict[str, Any], timeout: float
) -> None:
    """Each silo runs its exporters in its own process; receipts go back to their callbacks.
    A worker's exports for k silos, run one after another, are waited for k times `timeout`."""
    refs = {s: actors[s].export.remote() for s in silos}
    done = get_silos(refs, actors, "silo export", timeout)
    receipts = dict(zip(list(silos), done, strict=True))
    for index, callback in enumerate(callbacks):
        mine = {s: r[str(index)] for s, r in receipts.items() if str(index) in r}
        if mine:
            callback.on_exported(mine)
