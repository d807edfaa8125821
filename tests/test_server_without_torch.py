"""The server's process imports no torch (a torch import is 1-2 s of a run's start on two cores):
in a fresh process, its actor's module, its start as the driver sends it (SCAFFOLD's strategy and
an adaptive server optimizer included), a round's aggregation, its checkpoint and a resume from
it, with the same numbers as a server in a process that has torch."""

from __future__ import annotations

import pickle
import subprocess
import sys

import numpy as np
import pytest

from silo_pfl.config import to_dict
from silo_pfl.messages import SiloUpdate
from silo_pfl.server_start import new_server, server_start

CHILD = """
import pickle, sys
from silo_pfl.runtime.server_host import ServerHost
config, start, updates = pickle.load(sys.stdin.buffer)
host = ServerHost()
host.open(config, "no-torch")
host.build(start)
report, _, state, _ = host.aggregate([(0, i) for i in range(len(updates))], updates)
assert report.aggregated, report
host.checkpoint(1, {"summary": None, "selector": {}})
again = ServerHost()
again.open(config, "no-torch")
again.build(start)
again.resume()
assert again.server.round == 1
assert "torch" not in sys.modules, "the server imported torch"
sys.stdout.buffer.write(pickle.dumps(again.global_state()))
"""


def _updates(server, names, seed: int = 0) -> list[SiloUpdate]:
    rng = np.random.default_rng(seed)

    def like(state):
        return {k: rng.standard_normal(v.shape).astype(v.dtype) for k, v in state.items()}

    return [
        SiloUpdate(
            name,
            1,
            10 + i,
            like(server.state),
            extras={e: like(server.state) for e in server.strategy.extras},
        )
        for i, name in enumerate(names)
    ]


@pytest.mark.parametrize("overrides", [["algorithm.name=scaffold"], ["server.optimizer=adam"]])
def test_the_server_runs_a_round_checkpoints_and_resumes_without_torch(job, overrides):
    cfg = job("jobs/heart_disease.yaml", "algorithm.name=fedavg", *overrides)
    config = to_dict(cfg)
    start = server_start(cfg, (13,), 2, 389)
    here = new_server(config, (13,), 2)
    updates = _updates(here, start.silos)
    assert here.aggregate(*updates).aggregated
    payload = pickle.dumps((config, start, updates))
    child = subprocess.run(
        [sys.executable, "-c", CHILD], input=payload, capture_output=True, check=False
    )
    assert child.returncode == 0, child.stderr.decode()[-2000:]
    there = pickle.loads(child.stdout)
    assert set(there) == set(here.state)
    for key, value in here.state.items():
        assert np.array_equal(there[key], value), key
