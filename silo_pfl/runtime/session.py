"""Connecting to Ray: a local instance started on demand, or an existing cluster."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

import ray

from silo_pfl.config import RayConfig
from silo_pfl.errors import FederationError


@contextmanager
def ray_session(cfg: RayConfig) -> Iterator[None]:
    """Use the Ray already initialised in this process, or start/join one for the run's length.

    With no `ray.address`, a Ray Job's driver joins its cluster (Ray sets RAY_ADDRESS for it);
    anywhere else a fresh local instance is started, never a cluster left running on the machine.
    """
    if ray.is_initialized():
        yield
        return
    address = cfg.address or os.environ.get("RAY_ADDRESS")
    try:
        if address is None:
            ray.init(
                address="local",
                num_cpus=cfg.num_cpus,
                include_dashboard=False,
                log_to_driver=False,
                logging_level=logging.WARNING,
            )
        else:
            ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        where = address or "a local instance"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        hint = ""
        if address is not None and os.environ.get("RAY_AUTH_MODE") != "token":
            hint = (
                " (a cluster with token authentication needs RAY_AUTH_MODE=token, and its token "
                "in RAY_AUTH_TOKEN or ~/.ray/auth_token)"
            )
        raise FederationError(
            f"ray.address: cannot start or reach Ray at {where}: {first}{hint}"
        ) from None
    try:
        yield
    finally:
        ray.shutdown()
