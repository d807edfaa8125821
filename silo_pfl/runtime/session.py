"""Connecting to Ray: a local instance started on demand, or an existing cluster."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import ray

from silo_pfl.config import RayConfig
from silo_pfl.errors import FederationError


@contextmanager
def ray_session(cfg: RayConfig) -> Iterator[None]:
    """Use the Ray already initialised in this process, or start/join one for the run's length."""
    if ray.is_initialized():
        yield
        return
    try:
        if cfg.address is None:
            ray.init(
                num_cpus=cfg.num_cpus,
                include_dashboard=False,
                log_to_driver=False,
                logging_level=logging.WARNING,
            )
        else:
            ray.init(address=cfg.address, log_to_driver=False, logging_level=logging.WARNING)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        where = cfg.address or "a local instance"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise FederationError(
            f"ray.address: cannot start or reach Ray at {where}: {first}"
        ) from None
    try:
        yield
    finally:
        ray.shutdown()
