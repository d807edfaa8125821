"""The limit's workers as Ray actors: what Ray alone costs the same rounds.

`limit.py`'s worker processes become actors on a local Ray, dealt the silos the same way, and a
round is one call per actor (`limit.step`: evaluate the previous round's model, fit each silo)
with the global state, whose answers the driver averages. That is the fewest Ray calls a round
can take: no server actor, no checkpoints, no metrics. The global state goes as the call's
argument, inline where it is small (`runtime.session.INLINE_BYTES`), else put in the object
store once a round and read by every actor there, as a federation's is. So federation / this is
what silo_pfl adds over Ray, and this / limit is what Ray adds over pipes between processes.
"""

from __future__ import annotations

from collections.abc import Sequence

import ray
from limit import Answer, PlainSilo, State, deal, drive, plain_silos, step

from silo_pfl.data import silo_names
from silo_pfl.runtime.session import INLINE_BYTES
from silo_pfl.settings import load_config


@ray.remote(num_cpus=0)
class LimitWorker:
    """A limit worker holding some silos, in a Ray actor."""

    def __init__(self, job: str, overrides: Sequence[str], names: Sequence[str]) -> None:
        self.silos: list[PlainSilo] = plain_silos(job, overrides, names)

    def ready(self) -> None:
        """Answers once the silos are set up."""

    def step(self, state: State, round_: int) -> Answer:
        return step(self.silos, state, round_)


def run_ray_limit(
    job: str, overrides: Sequence[str], rounds: int, actors: int
) -> tuple[list[float], State]:
    """Seconds of each round on `actors` Ray actors (on the Ray this process started), and the
    final global model. Starting the actors and loading the data are not timed."""
    cfg = load_config(job, list(overrides))
    names = silo_names(cfg.data)
    workers = [LimitWorker.remote(job, list(overrides), group) for group in deal(names, actors)]

    def exchange(state: State, round_: int) -> list[Answer]:
        size = sum(v.nbytes for v in state.values())
        arg = ray.put(state) if size > INLINE_BYTES else state
        return ray.get([worker.step.remote(arg, round_) for worker in workers])

    try:
        ray.get([worker.ready.remote() for worker in workers])  # set up: not timed
        return drive(cfg, rounds, exchange)
    finally:
        for worker in workers:
            ray.kill(worker)
