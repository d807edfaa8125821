"""Every registered algorithm on every job, with `algorithm.name=<name>` and nothing else
changed: it runs a round (two silos, plain classes, real data), or it refuses at config load in
one line. The data of jobs/hospitals_on_nodes.yaml is laid out as on each hospital's node."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from silo_pfl.algorithms import ALGORITHMS
from silo_pfl.config import to_dict
from silo_pfl.data import silo_names
from silo_pfl.errors import ConfigError
from silo_pfl.server_start import new_server
from silo_pfl.silo import Silo

ROOT = Path(__file__).resolve().parents[1]
JOBS = sorted(p.name for p in (ROOT / "jobs").glob("*.yaml"))
sys.path.insert(0, str(ROOT / "cluster"))
from hospital_data import write_hospital  # noqa: E402

# The one refusal expected: fedbn keeps the BatchNorm keys, and only cnn_small_bn has any.
REFUSALS = {
    "fedbn": "algorithm.name: fedbn keeps split.local=['batchnorm'] by default, but on model"
}


@pytest.fixture(scope="module")
def hospital_dir(tmp_path_factory) -> Path:
    """cleveland/heart.csv: the data jobs/hospitals_on_nodes.yaml finds on a hospital's node."""
    root = tmp_path_factory.mktemp("nodes")
    write_hospital(root, "cleveland")
    return root / "cleveland"


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_every_algorithm_runs_on_every_job_or_refuses_in_one_line(
    job, algorithm, hospital_dir, monkeypatch
):
    monkeypatch.setenv("SILO_PFL_DATA_DIR", str(hospital_dir))
    if ALGORITHMS[algorithm].__module__.startswith("tests."):
        pytest.skip("a test plugin's algorithm")
    refused = set()
    for name in JOBS:
        try:
            cfg = job(str(ROOT / "jobs" / name), f"algorithm.name={algorithm}", "round.min_silos=2")
        except ConfigError as exc:
            assert "\n" not in str(exc) and str(exc).startswith(REFUSALS.get(algorithm, "?")), (
                name,
                exc,
            )
            refused.add(name)
            continue
        config = to_dict(cfg)
        silos = [Silo(config, silo) for silo in silo_names(cfg.data)[:2]]
        infos = [silo.setup() for silo in silos]
        shape, classes = infos[0].input_shape, max(i.num_classes for i in infos)
        for silo in silos:
            silo.build(shape, classes)
        server = new_server(config, shape, classes)
        state, broadcast = server.global_state(), server.broadcast()
        updates = [silo.fit(state, 1, 1, broadcast)[0] for silo in silos]
        assert server.aggregate(*updates).aggregated, (name, algorithm)
        accuracy = [silo.evaluate(server.global_state(), 1).val_accuracy for silo in silos]
        assert all(np.isfinite(accuracy)), (name, algorithm, accuracy)
    without_batchnorm = {n for n in JOBS if n != "digits_feature_shift.yaml"}
    assert refused == (without_batchnorm if algorithm == "fedbn" else set()), refused
