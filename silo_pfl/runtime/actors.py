"""The silo and server actors: the plain classes, made remote late with their placement."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import ray

from silo_pfl.config import FederationConfig
from silo_pfl.errors import FederationError, SiloPflError
from silo_pfl.messages import EvalMetrics, FitMetrics, RoundReport, SiloInfo, SiloUpdate
from silo_pfl.runtime.metrics import ServerMetrics, SiloMetrics
from silo_pfl.runtime.placement import actor_options, server_selector, silo_selector
from silo_pfl.server import Server
from silo_pfl.silo import Silo

# Actor id (hex) -> what it is ("silo va", "the server"), so a death can be reported by name.
_ROLES: dict[str, str] = {}


# A silo's process may die (its node reboots, it is pre-empted) any number of times: Ray starts
# it again and the driver has it restore its last commit. Tasks are not retried by Ray: the
# round decides what a restarted silo does next.
SILO_MAX_RESTARTS = -1


class SiloActor(Silo):
    """A Silo that also reports the Ray node it runs on and, given the run's metric tags,
    records its figures as live metrics."""

    def __init__(
        self,
        config: dict[str, Any],
        name: str,
        run_id: str = "default",
        metric_tags: dict[str, str] | None = None,
    ) -> None:
        super().__init__(config, name, run_id)
        self.metrics = SiloMetrics(metric_tags, name) if metric_tags is not None else None

    def setup(self, resume: bool = False) -> SiloInfo:
        info = super().setup(resume)
        return dataclasses.replace(info, node_id=ray.get_runtime_context().get_node_id())

    def fit(
        self,
        global_state: dict[str, np.ndarray],
        round_: int,
        attempt: int = 1,
        broadcast: dict[str, Any] | None = None,
    ) -> tuple[SiloUpdate | None, FitMetrics]:
        update, metrics = super().fit(global_state, round_, attempt, broadcast)
        if self.metrics is not None:
            self.metrics.fit(metrics)
        return update, metrics

    def evaluate(self, global_state: dict[str, np.ndarray], round_: int) -> EvalMetrics:
        metrics = super().evaluate(global_state, round_)
        if self.metrics is not None:
            self.metrics.evaluate(metrics)
        return metrics


class ServerActor(Server):
    """A Server that can say which Ray node it runs on and, given the run's metric tags,
    records its unmasking as a live metric."""

    def __init__(
        self,
        config: dict[str, Any],
        input_shape: Sequence[int],
        num_classes: int,
        run_id: str = "default",
        metric_tags: dict[str, str] | None = None,
    ) -> None:
        super().__init__(config, input_shape, num_classes, run_id)
        self.metrics = ServerMetrics(metric_tags) if metric_tags is not None else None

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def aggregate(self, *updates: SiloUpdate) -> RoundReport:
        report = super().aggregate(*updates)
        if self.metrics is not None:
            self.metrics.aggregated(report)
        return report


def start_silo(
    cfg: FederationConfig,
    config: dict[str, Any],
    silo: str,
    run_id: str,
    metric_tags: dict[str, str] | None = None,
) -> Any:
    """Start the actor of one silo, on a node carrying its label if it has one; with
    `metric_tags` it records live metrics."""
    options: dict[str, Any] = {"num_cpus": cfg.ray.silo_cpus, "max_restarts": SILO_MAX_RESTARTS}
    options.update(actor_options(silo_selector(cfg, silo)))
    actor = ray.remote(SiloActor).options(**options).remote(config, silo, run_id, metric_tags)
    return _named(actor, f"silo {silo}")


def start_server(
    cfg: FederationConfig,
    config: dict[str, Any],
    input_shape: Sequence[int],
    num_classes: int,
    run_id: str,
    metric_tags: dict[str, str] | None = None,
) -> Any:
    """Start the server actor: where server.node_label says, else on the head under per_node.
    It is not restarted: the run fails, and `--resume` continues from its last checkpoint."""
    options: dict[str, Any] = {"num_cpus": 0, "max_restarts": 0}
    options.update(actor_options(server_selector(cfg), cfg.ray.placement == "per_node"))
    server = ray.remote(ServerActor).options(**options)
    actor = server.remote(config, tuple(input_shape), num_classes, run_id, metric_tags)
    return _named(actor, "the server")


def _named(actor: Any, role: str) -> Any:
    """Remember what `actor` is, for error messages."""
    _ROLES[actor._actor_id.hex()] = role
    return actor


def task_error_cause(exc: ray.exceptions.RayTaskError) -> BaseException:
    """The exception an actor's method raised, unwrapped from Ray's wrapper."""
    return exc.cause if isinstance(getattr(exc, "cause", None), BaseException) else exc


def get(refs: Any, what: str, timeout: float | None = None, names: Sequence[str] = ()) -> Any:
    """ray.get that surfaces a user error from an actor as itself, and anything else in one line.

    `names` says whose each of a list of refs is ("silo va"): a timeout names who did not answer.
    """
    try:
        return ray.get(refs, timeout=timeout)
    except ray.exceptions.RayTaskError as exc:
        _collect_the_rest(refs)
        cause = task_error_cause(exc)
        if isinstance(cause, SiloPflError):
            raise cause from None
        first = str(cause).strip().splitlines()[-1] if str(cause).strip() else ""
        raise FederationError(f"{what} failed: {type(cause).__name__}: {first}") from exc
    except ray.exceptions.GetTimeoutError:
        late = ""
        if names and isinstance(refs, list):
            _, pending = ray.wait(refs, num_returns=len(refs), timeout=0)
            late = " from " + ", ".join(n for n, r in zip(names, refs, strict=True) if r in pending)
        raise FederationError(f"{what}: no answer within {timeout:g} s{late}") from None
    except ray.exceptions.RayActorError as exc:
        who = _ROLES.get(getattr(exc, "actor_id", None) or "", "an actor")
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise FederationError(f"{what}: {who} died ({type(exc).__name__}: {first})") from exc


def _collect_the_rest(refs: Any) -> None:
    """After one ref's error, fetch the others that are done, so that Ray does not log their
    errors again as unhandled once the refs are dropped."""
    if not isinstance(refs, list):
        return
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=1.0)
    for ref in ready:
        with contextlib.suppress(Exception):
            ray.get(ref)


def stop(actors: Sequence[Any]) -> None:
    """Stop actors; they hold no state the run still needs."""
    for actor in actors:
        ray.kill(actor, no_restart=True)
        _ROLES.pop(actor._actor_id.hex(), None)
