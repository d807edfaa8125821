"""A small federation on the plain Silo and Server classes (no Ray), for tests of an
algorithm's procedure: real hospitals' data, every update checked and aggregated."""

from __future__ import annotations

import numpy as np

from silo_pfl.config import to_dict
from silo_pfl.server import Server
from silo_pfl.silo import Silo

SILOS = ("cleveland", "hungarian")
JOB = "jobs/heart_disease.yaml"


def federation(
    job, algorithm: str, *overrides: str, silos: tuple[str, ...] = SILOS
) -> tuple[list[Silo], Server]:
    """Those silos of the heart-disease job, set up and built, and their server."""
    quorum = f"round.min_silos={len(silos)}"
    config = to_dict(job(JOB, f"algorithm.name={algorithm}", quorum, *overrides))
    members = [Silo(config, name) for name in silos]
    infos = [silo.setup() for silo in members]
    public = {i.silo: i.public_key for i in infos if i.public_key}
    for silo in members:
        silo.build(infos[0].input_shape, infos[0].num_classes, public)
    return members, Server(config, infos[0].input_shape, infos[0].num_classes)


def play_round(silos: list[Silo], server: Server, round_: int, commit: bool = False):
    """One round; with `commit`, each silo commits it (so the next fit starts from it; without,
    the next fit rolls back to the last commit). Returns the updates, the new global state and
    the evaluations."""
    start, broadcast = server.global_state(), server.broadcast()
    updates = [silo.fit(start, round_, 1, broadcast)[0] for silo in silos]
    assert server.aggregate(*updates).aggregated
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
