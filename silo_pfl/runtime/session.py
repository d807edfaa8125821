"""Connecting to Ray: a local instance started on demand, or an existing cluster."""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import ray

from silo_pfl.config import RayConfig
from silo_pfl.errors import FederationError, one_line
from silo_pfl.runtime.discovery import write_discovery_file
from silo_pfl.runtime.metrics import ray_address
from silo_pfl.runtime.ray_token import ensure_local_token


@contextmanager
def ray_session(cfg: RayConfig, metrics_interval_s: float | None = None) -> Iterator[None]:
    """Use the Ray already initialised in this process, or start/join one for the run's length.

    With no `ray.address`, a Ray Job's driver joins its cluster (Ray sets RAY_ADDRESS for it);
    anywhere else a fresh local instance is started, never a cluster left running on the machine.
    A local instance never starts Ray's dashboard. With live metrics on (`metrics_interval_s`
    given), its processes export every `metrics_interval_s` seconds (unless
    RAY_metrics_report_interval_ms says otherwise) to its metrics agent, which runs either way,
    and the run writes the Prometheus service-discovery file the dashboard would have written.
    """
    if ray.is_initialized():
        yield
        return
    address = ray_address(cfg.address)
    try:
        if address is None:
            ensure_local_token()
            with _export_interval(metrics_interval_s):
                ray.init(**local_options(cfg))
            if metrics_interval_s is not None:
                write_discovery_file()
        else:
            ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        where = address or "a local instance"
        hint = ""
        if address is not None and os.environ.get("RAY_AUTH_MODE") != "token":
            hint = (
                " (a cluster with token authentication needs RAY_AUTH_MODE=token, and its token "
                "in RAY_AUTH_TOKEN or ~/.ray/auth_token)"
            )
        raise FederationError(
            f"ray.address: cannot start or reach Ray at {where}: {one_line(exc)}{hint}"
        ) from None
    try:
        with _sigterm_interrupts():
            yield
    finally:
        if address is None:
            shutdown_local()
        else:
            ray.shutdown()


def shutdown_local() -> None:
    """`ray.shutdown` of a local instance this process started, without its one-second wait."""
    stop_autoscaler_monitor()
    ray.shutdown()


def local_options(cfg: RayConfig) -> dict[str, Any]:
    """ray.init's options for a fresh local instance, without Ray's dashboard."""
    return {
        "address": "local",
        "num_cpus": cfg.num_cpus,
        "include_dashboard": False,
        "log_to_driver": False,
        "logging_level": logging.WARNING,
    }


def stop_autoscaler_monitor() -> None:
    """Kill the autoscaler monitor of the local instance this process started, before
    `ray.shutdown`. A local instance has nothing to autoscale, and Ray stops the monitor after its
    GCS: on SIGTERM the monitor then tries to report to that GCS and is killed a second later,
    which made every local shutdown wait a second. Ray's node object is private: where it has
    another shape, this does nothing and the shutdown waits as before."""
    node = getattr(ray._private.worker, "_global_node", None)
    infos = getattr(node, "all_processes", {}).get("monitor", [])
    for info in infos:
        process = getattr(info, "process", None)
        if process is not None and process.poll() is None:
            process.kill()
            process.wait(timeout=5)


@contextmanager
def _export_interval(seconds: float | None) -> Iterator[None]:
    """While a local Ray starts, RAY_metrics_report_interval_ms for the processes it spawns (they
    inherit it; its workers from its raylet), unless the environment sets it already."""
    name = "RAY_metrics_report_interval_ms"
    if seconds is None or name in os.environ:
        yield
        return
    os.environ[name] = str(round(seconds * 1000))
    try:
        yield
    finally:
        del os.environ[name]


def _interrupt(signum: int, frame: Any) -> None:
    """Raise KeyboardInterrupt once; a second SIGTERM cannot cut the clean-up short."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt


@contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """While the run uses Ray, SIGTERM (what `ray job stop` and `silo-pfl stop` send) stops it as
    Ctrl-C does: actors released, the MLflow run KILLED. Ray's own driver handler would abort."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
