"""The local Ray a test session shares (conftest's `ray_local`), as one function, so that
`benchmarks/idle_cluster.py` measures the same instance."""

from __future__ import annotations

import logging


def start() -> None:
    """Start a fresh local Ray in this process: 2 CPUs, no dashboard, quiet, with the system
    settings of a run's local Ray."""
    import ray

    from silo_pfl.runtime.session import local_system_config

    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        logging_level=logging.WARNING,
        # As cluster/local_cluster.py starts a cluster: every process, and every driver that
        # joins it, sends its metrics each second (Ray's default is 10 s), so a run that joins
        # waits 1 s, not 10, at its end for its last figures to be sent.
        _system_config={**local_system_config(), "metrics_report_interval_ms": 1000},
    )
