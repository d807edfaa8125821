"""What the silos are told of a round is its verdict (aggregated, and whose updates), never the
server's reasons for the others' rejections, which name a silo's update norm."""

from __future__ import annotations

import pickle

import numpy as np

from silo_pfl.config import to_dict
from silo_pfl.messages import SiloUpdate, Verdict
from silo_pfl.runtime.server_host import ServerHost
from silo_pfl.server_start import server_start


def test_the_silos_verdict_holds_no_other_silos_reason(job):
    cfg = job(
        "jobs/heart_disease.yaml",
        "algorithm.name=fedavg",
        "aggregation.max_update_norm=50",
        "round.min_silos=3",
    )
    start = server_start(cfg, (13,), 2, 389)
    host = ServerHost()
    host.open(to_dict(cfg), "verdict")
    host.build(start)
    rng = np.random.default_rng(0)
    state = host.server.state
    updates = [
        SiloUpdate(
            name,
            1,
            10 + i,
            {
                k: rng.standard_normal(v.shape).astype(v.dtype) * (100 if i == 0 else 1e-3)
                for k, v in state.items()
            },
        )
        for i, name in enumerate(start.silos)
    ]
    report, verdict, _, _ = host.aggregate([(0, i) for i in range(len(updates))], updates)
    rejected = start.silos[0]
    assert report.aggregated and set(report.rejected) == {rejected}
    assert "norm" in report.rejected[rejected]
    assert verdict == Verdict(1, True, report.accepted) and rejected not in verdict.accepted
    told = pickle.dumps(verdict)
    assert rejected.encode() not in told and b"norm" not in told
