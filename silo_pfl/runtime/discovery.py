"""Prometheus' service-discovery file for a local Ray started without its dashboard.

On a cluster the head's dashboard keeps `prom_metrics_service_discovery.json` up to date. A local
run with metrics on writes the same file, in the same place and format, once: its one node does
not change, and starting the dashboard just for this file costs seconds of start-up and a
process competing with the silos for the cores.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import ray

from silo_pfl.errors import ConfigError

DISCOVERY_FILE = "prom_metrics_service_discovery.json"  # Ray's name for it


def metrics_targets() -> list[str]:
    """host:port of the metrics agent of every live node."""
    return [
        f"{node['NodeManagerAddress']}:{node['MetricsExportPort']}"
        for node in ray.nodes()
        if node["Alive"]
    ]


def write_discovery_file() -> Path:
    """Write the file into this Ray session's directory, atomically, and link it from the Ray
    temp directory, as Ray's own writer does; returns the file's path."""
    node = ray._private.worker._global_node
    session = Path(node.get_session_dir_path())
    target = session / DISCOVERY_FILE
    content = [{"labels": {"job": "ray"}, "targets": metrics_targets()}]
    partial = session / f"tmp_{DISCOVERY_FILE}"
    legacy = Path(node.get_temp_dir_path()) / DISCOVERY_FILE
    try:
        partial.write_text(json.dumps(content))
        os.replace(partial, target)
        if legacy != target:
            legacy.unlink(missing_ok=True)
            legacy.symlink_to(target)
    except OSError as exc:
        raise ConfigError(
            f"metrics.enabled: cannot write Prometheus' service-discovery file {exc.filename} "
            f"({exc.strerror or type(exc).__name__}); expected a file this user can replace in "
            "Ray's temp directory ($RAY_TMPDIR), or metrics.enabled=false"
        ) from None
    return target
