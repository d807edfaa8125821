"""The local Ray a test session shares (conftest's `ray_local`), as one function, so that
`benchmarks/idle_cluster.py` measures the same instance."""

from __future__ import annotations

# An environment variable that conftest sets before any Ray of the session starts, so that its
# workers (the silos' "nodes") have it; a test removes it from the driver to show that a silo
# fills in its own $VARS (test_tracking).
NODE_ONLY_VAR = "SILO_PFL_TEST_PREMISES"


def start() -> None:
    """Start a fresh local Ray in this process as a run starts its own (`local_options`), with
    2 CPUs."""
    import ray

    from silo_pfl.config import RayConfig
    from silo_pfl.runtime.session import local_options

    options = local_options(RayConfig(num_cpus=2))
    # As cluster/local_cluster.py starts a cluster: every process, and every driver that joins
    # it, sends its metrics each second (Ray's default is 10 s), so a run that joins waits 1 s,
    # not 10, at its end for its last figures to be sent.
    options["_system_config"]["metrics_report_interval_ms"] = 1000
    ray.init(**options)
