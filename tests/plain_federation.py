"""A small federation on the plain Silo and Server classes (no Ray), for tests of an
algorithm's procedure: real hospitals' data, every update checked and aggregated."""

from __future__ import annotations

import numpy as np
from secure_protocol import confirmed

from silo_pfl.config import to_dict
from silo_pfl.messages import FitMetrics, RoundReport, SiloUpdate
from silo_pfl.server import Server
from silo_pfl.server_start import new_server
from silo_pfl.silo import Silo

SILOS = ("cleveland", "hungarian")
JOB = "jobs/heart_disease.yaml"


def federation(
    job, algorithm: str, *overrides: str, silos: tuple[str, ...] = SILOS, path: str = JOB
) -> tuple[list[Silo], Server]:
    """Those silos of the job at `path` (by default the heart-disease job), set up and built,
    and their server."""
    quorum = f"round.min_silos={len(silos)}"
    config = to_dict(job(path, f"algorithm.name={algorithm}", quorum, *overrides))
    members = [Silo(config, name) for name in silos]
    infos = [silo.setup() for silo in members]
    identities = {i.silo: i.identity_key for i in infos if i.identity_key}
    for silo in members:
        silo.build(infos[0].input_shape, infos[0].num_classes, identities)
    return members, new_server(config, infos[0].input_shape, infos[0].num_classes)


def fit_all(
    silos: list[Silo], server: Server, round_: int, attempt: int = 1, sent: list | None = None
) -> list[tuple[SiloUpdate | None, FitMetrics]]:
    """Every silo's fit on the server's state; under aggregation.secure, after the protocol's
    first two steps (advertise, share keys), relayed here as the driver would. Everything the
    silos hand out is appended to `sent`."""
    sent = [] if sent is None else sent
    start, broadcast = server.global_state(), server.broadcast()
    inbox: dict[str, dict[str, bytes]] = {}
    if server.protocol is not None:
        adverts = [silo.advertise(round_, attempt) for silo in silos]
        server.enroll(round_, attempt, adverts)
        bundles = [silo.share_keys(adverts) for silo in silos]
        sent += [*adverts, *bundles]
        inbox = server.route(bundles)
    fits = [silo.fit(start, round_, attempt, broadcast, inbox.get(silo.name)) for silo in silos]
    sent += [part for fit in fits for part in fit]
    return fits


def aggregate(
    silos: list[Silo], server: Server, updates: list[SiloUpdate], sent: list | None = None
) -> RoundReport:
    """The server's aggregation; under aggregation.secure, with the survivors' reveals (which
    are appended to `sent`)."""
    report = server.aggregate(*updates)
    if report.unmask is None:
        return report
    by_name = {silo.name: silo for silo in silos}
    request = confirmed(by_name, report.unmask)
    reveals = [by_name[n].unmask(request) for n in request.survivors]
    if sent is not None:
        sent += reveals
    return server.unmask(*reveals)


def play_round(silos: list[Silo], server: Server, round_: int, commit: bool = False):
    """One round; with `commit`, each silo commits it (so the next fit starts from it; without,
    the next fit rolls back to the last commit). Returns the updates, the new global state and
    the evaluations."""
    updates = [update for update, _ in fit_all(silos, server, round_)]
    assert aggregate(silos, server, updates).aggregated
    state = server.global_state()
    evals = [silo.evaluate(state, round_) for silo in silos]
    if commit:
        for silo in silos:
            silo.commit(round_, keep=True)
    return updates, state, evals


def same_updates(a, b) -> bool:
    """The two rounds' updates hold the same keys and values, silo by silo."""
    return all(
        set(x.delta) == set(y.delta)
        and all(np.array_equal(x.delta[k], y.delta[k]) for k in x.delta)
        for x, y in zip(a, b, strict=True)
    )
