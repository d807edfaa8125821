"""The silo and server actors: plain classes hosted in Ray worker processes, started early.

A silo worker (`SiloHost`) holds one or more silos (`SiloGroup`); the driver sees each silo
through a `SiloHandle`, which calls its worker with the silo's name, so rounds, rejoins and
exports address silos alike however they are packed. The server's worker starts with the silos'
(its torch import overlaps theirs) and builds its model once they have reported their shapes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ray

from silo_pfl import durable
from silo_pfl.config import FederationConfig
from silo_pfl.config_views import actor_view
from silo_pfl.errors import FederationError, SiloLost, SiloPflError, scrub, typed_line
from silo_pfl.messages import CallFailed, Verdict
from silo_pfl.runtime import host_pool, huge_pages
from silo_pfl.runtime.metrics import SiloMetrics
from silo_pfl.runtime.placement import actor_options, server_selector, silo_selector
from silo_pfl.runtime.server_host import ServerHost
from silo_pfl.silo_group import API, SiloGroup

# Actor id (hex) -> what it is ("silo va", "the server"), so a death can be reported by name.
_ROLES: dict[str, str] = {}


# A silo's process may die (its node reboots, it is pre-empted) any number of times: Ray starts
# it again and the driver has each of its silos restore its last commit. Tasks are not retried
# by Ray: the round decides what a restarted silo does next.
SILO_MAX_RESTARTS = -1


class SiloHost:
    """A Ray worker holding the silos of one run (one, or several packed), each with its own
    state and random generators. It starts empty and is opened for a run's silos; closed, it
    may serve the next run of the session (runtime.host_pool). It reports the node it runs on
    and, given the run's metric tags, records each silo's figures as live metrics."""

    def __init__(self) -> None:
        huge_pages.no_advice()
        self.group: SiloGroup | None = None
        self.opened: tuple[str, tuple[str, ...]] | None = None  # (run id, silos)
        self.metrics: dict[str, SiloMetrics] = {}
        # Silos this worker held before it restarted and has not restored yet (rejoin).
        self.lost: set[str] = set()
        self.failed: Exception | None = None  # why the last `open` failed

    def open(
        self,
        config: dict[str, Any],
        names: Sequence[str],
        run_id: str = "default",
        metric_tags: dict[str, str] | None = None,
    ) -> None:
        """Hold the silos `names` of run `run_id`, as `config` (their view of it) describes.
        Where that fails (a plugin this node cannot import), each call answers its error; this
        one does not raise it, as no one waits on it (Ray would print its traceback)."""
        self.close()
        try:
            self.group = SiloGroup(config, names, run_id)
        except Exception as exc:
            self.failed = exc
            return
        for silo in self.group.silos.values():
            silo.inputs_immutable = True  # what a call receives is read from the object store
        self.opened = (run_id, tuple(names))
        if metric_tags is not None:
            self.metrics = {name: SiloMetrics(metric_tags, name) for name in names}

    def close(self) -> None:
        """Drop the run's silos: nothing of them stays in the process."""
        self.group, self.opened, self.metrics, self.lost = None, None, {}, set()
        self.failed = None
        gc.collect()

    def rejoin(self, name: str, opening: Opening, *args: Any) -> Any:
        """Silo `name`'s rejoin after its worker restarted (and came back empty): the worker is
        opened again for its run first, and its other silos stay lost until they rejoin too."""
        if self.opened != (opening.run_id, tuple(opening.names)):
            self.open(*opening.args())
            self.lost = set(opening.names)
        self.lost.discard(name)
        try:
            return self.call(name, "rejoin", *args)
        except BaseException:
            self.lost.add(name)
            raise

    def call(self, name: str, method: str, *args: Any) -> Any:
        """Silo `name`'s `method`; what it returns goes back to the driver. A silo this worker
        no longer holds (it restarted, idle or not, since the silo last answered) is SiloLost."""
        if self.group is None and self.failed is not None:
            raise self.failed.with_traceback(None)  # a fresh traceback each time, not a longer one
        if self.group is None or name in self.lost:
            raise SiloLost(
                f"silo {name}: its worker restarted since its last call, and holds it no more"
            )
        result = self.group.call(name, method, *args)
        if method == "setup":
            result = dataclasses.replace(result, node_id=ray.get_runtime_context().get_node_id())
        recorder = self.metrics.get(name)
        if recorder is not None and method == "fit":
            recorder.fit(result[1])
        elif recorder is not None and method in ("evaluate", "evaluate_and_commit"):
            recorder.evaluate(result)
        return result

    def many(
        self,
        report: Verdict | None,
        accepted_only: bool,
        method: str,
        names: Sequence[str],
        each: int,
        per_silo: Mapping[str, Any] | None,
        *args: Any,
    ) -> Any:
        """`method` of each of `names`, one after another (called with num_returns=each): for
        each of a silo's `each` answers, the list of every silo's, one object for all, since
        Ray pays for each object returned (a fit's updates, for the server, and its metrics, for
        the driver, are two). A silo whose call raised answers its error in each place.
        `per_silo` gives each silo one more argument of its own, after `args`. The checkpoints
        the silos write reach the disk together, as the call ends. A call sent before its
        round's aggregation is known is given the round's `report` (else None) and runs once it
        is in, for the silos it lets go on: none if the round was not aggregated, else all (with
        `accepted_only`, those whose update was aggregated); the others answer CallFailed."""
        lists: list[list[Any]] = [[] for _ in range(each)]
        with durable.durable_together():
            for name in names:
                own = (per_silo[name],) if per_silo is not None else ()
                stop = _stopped(report, accepted_only, name)
                answer = CallFailed(stop) if stop else self._guarded(name, method, *args, *own)
                if each == 1 or isinstance(answer, CallFailed):
                    answer = (answer,) * each
                for answers, one in zip(lists, answer, strict=True):
                    answers.append(one)
        return lists[0] if each == 1 else tuple(lists)

    def _guarded(self, name: str, method: str, *args: Any) -> Any:
        """One silo's call in a call made for several: its error is its answer, not theirs."""
        try:
            return self.call(name, method, *args)
        except Exception as exc:
            return CallFailed(typed_line(exc), lost=isinstance(exc, SiloLost))


def _stopped(report: Verdict | None, accepted_only: bool, name: str) -> str:
    """Why `report` stops silo `name`'s call sent before it ('' if it does not)."""
    if report is not None and not report.aggregated:
        return f"round {report.round} was not aggregated"
    if report is not None and accepted_only and name not in report.accepted:
        return f"its update of round {report.round} was not aggregated"
    return ""


@dataclasses.dataclass(frozen=True)
class Shared:
    """One silo's answer in its worker's list of answers: item `index` of the object `ref`."""

    ref: Any
    index: int


def picked(items: Sequence[Shared]) -> tuple[list[tuple[int, int]], list[Any]]:
    """What a call on `items` is sent: the objects they are items of, each once, as arguments of
    their own (Ray hands the callee an argument's object, not a ref inside a list), and for each
    item, which argument and which item of it (`ServerHost.aggregate`)."""
    objects: dict[Any, int] = {}
    picks = [(objects.setdefault(item.ref, len(objects)), item.index) for item in items]
    return picks, list(objects)


def call_many(
    handles: Mapping[str, SiloHandle],
    method: str,
    *args: Any,
    each: int = 1,
    per_silo: Mapping[str, Any] | None = None,
    after: Any = None,
    accepted_only: bool = False,
) -> dict[str, list[Any]]:
    """`method` of every silo of `handles`, one call (`SiloHost.many`, named `<method>_many`)
    per worker for all its silos there; each silo's `each` answers, which arrive when its
    worker's call ends, as `Shared` items of the worker's `each` lists (`rounds.gather` reads
    them, `picked` passes them on). `per_silo[name]` is an argument for that silo only. With
    `after` (the ref of a round's report), the call runs once the report is in, and only for
    the silos it lets go on (`SiloHost.many`)."""
    by_host: dict[Any, tuple[Any, list[str]]] = {}
    for name, handle in handles.items():
        by_host.setdefault(handle.host._actor_id, (handle.host, []))[1].append(name)
    refs: dict[str, list[Any]] = {}
    for host, names in by_host.values():
        own = {n: per_silo[n] for n in names} if per_silo is not None else None
        call = host.many.options(num_returns=each, name=f"{method}_many")
        out = call.remote(after, accepted_only, method, names, each, own, *args)
        out = [out] if each == 1 else list(out)
        for i, name in enumerate(names):
            refs[name] = [Shared(ref, i) for ref in out]
    return refs


def _forwarder(method: str) -> Callable[..., Any]:
    """SiloHost.<method>(name, *args): silo `name`'s `method`, a task of its own name in Ray."""

    def forward(self: SiloHost, name: str, *args: Any) -> Any:
        return self.call(name, method, *args)

    forward.__name__ = forward.__qualname__ = method
    forward.__doc__ = f"Silo `name`'s {method}."
    return forward


for _method in sorted(API - {"rejoin"}):
    setattr(SiloHost, _method, _forwarder(_method))


@dataclasses.dataclass(frozen=True)
class Opening:
    """What a silo worker is opened with for a run (`SiloHost.open`'s arguments)."""

    config: dict[str, Any]
    names: tuple[str, ...]
    run_id: str
    metric_tags: dict[str, str] | None

    def args(self) -> tuple[Any, ...]:
        return self.config, self.names, self.run_id, self.metric_tags


class SiloHandle:
    """The driver's handle on one silo: `handle.fit.remote(...)` calls `fit` of that silo in
    its worker; `handle.fit.options(num_returns=2)` passes Ray's call options through."""

    def __init__(self, host: Any, name: str, opening: Opening) -> None:
        self.host = host
        self.name = name
        self.opening = opening

    def __getattr__(self, method: str) -> _SiloMethod:
        if method not in API:
            raise AttributeError(f"{method!r} is not part of a silo's API")
        if method == "rejoin":
            return _SiloMethod(self.host.rejoin, self.name, (self.opening,))
        return _SiloMethod(getattr(self.host, method), self.name)


@dataclasses.dataclass(frozen=True)
class _SiloMethod:
    actor_method: Any
    silo: str
    first: tuple[Any, ...] = ()  # arguments of the worker's own before the caller's

    def remote(self, *args: Any) -> Any:
        return self.actor_method.remote(self.silo, *self.first, *args)

    def options(self, **options: Any) -> _SiloMethod:
        return _SiloMethod(self.actor_method.options(**options), self.silo, self.first)


def start_silos(
    cfg: FederationConfig,
    config: dict[str, Any],
    groups: Sequence[Sequence[str]],
    run_id: str,
    metric_tags: dict[str, str] | None = None,
    keep: bool = False,
) -> dict[str, SiloHandle]:
    """Start a worker per group of silos (see runtime.packing), on a node carrying their label
    if they have one; return a handle per silo. Each worker is given only its silos' view of
    `config` (config_views.actor_view). With `metric_tags` they record live metrics. With
    `keep` (Ray outlives the run) an idle worker of the session may serve (runtime.host_pool)."""
    handles: dict[str, SiloHandle] = {}
    for names in groups:
        options: dict[str, Any] = {
            "num_cpus": cfg.ray.silo_cpus * len(names),
            "max_restarts": SILO_MAX_RESTARTS,
        }
        options.update(actor_options(silo_selector(cfg, names[0])))
        opening = Opening(actor_view(config, names), tuple(names), run_id, metric_tags)
        host = host_pool.start(SiloHost, options, keep and metric_tags is None)
        host.open.remote(*opening.args())
        who = f"silo {names[0]}" if len(names) == 1 else f"the worker of silos {', '.join(names)}"
        _named(host, who)
        handles.update({name: SiloHandle(host, name, opening) for name in names})
    return handles


def start_silo(
    cfg: FederationConfig,
    config: dict[str, Any],
    silo: str,
    run_id: str,
    metric_tags: dict[str, str] | None = None,
    keep: bool = False,
) -> SiloHandle:
    """Start one silo in its own worker."""
    return start_silos(cfg, config, [[silo]], run_id, metric_tags, keep)[silo]


def start_server(
    cfg: FederationConfig,
    config: dict[str, Any],
    run_id: str,
    metric_tags: dict[str, str] | None = None,
    keep: bool = False,
) -> Any:
    """Start the server actor: where server.node_label says, else on the head under per_node.
    It is not restarted: the run fails, and `--resume` continues from its last checkpoint.
    `build` gives it its model once the silos' shapes are known."""
    options: dict[str, Any] = {"num_cpus": 0, "max_restarts": 0}
    options.update(actor_options(server_selector(cfg), cfg.ray.placement == "per_node"))
    actor = host_pool.start(ServerHost, options, keep and metric_tags is None)
    actor.open.remote(actor_view(config, ()), run_id, metric_tags)
    return _named(actor, "the server")


def _named(actor: Any, role: str) -> Any:
    """Remember what `actor` is, for error messages."""
    _ROLES[actor._actor_id.hex()] = role
    return actor


def task_error_cause(exc: ray.exceptions.RayTaskError) -> BaseException:
    """The exception an actor's method raised, unwrapped from Ray's wrapper."""
    return exc.cause if isinstance(getattr(exc, "cause", None), BaseException) else exc


def silos_in_call(handles: Mapping[str, Any]) -> dict[str, int]:
    """Silo -> how many of the silos of `handles` its worker holds (an actor that is not a
    silo's handle is a worker of its own). A worker runs its silos' calls one after another,
    so a step waits for it that many times its timeout."""
    workers = {name: _worker(handle) for name, handle in handles.items()}
    counts = Counter(workers.values())
    return {name: counts[worker] for name, worker in workers.items()}


def _worker(handle: Any) -> Any:
    """What identifies the worker process `handle` calls."""
    return handle.host._actor_id if isinstance(handle, SiloHandle) else id(handle)


def wait_each(objects: Mapping[Any, int], timeout: float, start: float | None = None) -> list[Any]:
    """The objects ready before each one's deadline: `timeout` s from `start` (time.monotonic;
    default now) for each silo it answers for, as `objects` counts them (a worker runs its silos
    one after another)."""
    start = time.monotonic() if start is None else start
    ready: set[Any] = set()
    pending = dict(objects)
    while pending:
        left = {o: start + k * timeout - time.monotonic() for o, k in pending.items()}
        waiting = [o for o, seconds in left.items() if seconds > 0]
        if not waiting:
            break
        wait = min(left[o] for o in waiting)
        done, _ = ray.wait(waiting, num_returns=len(waiting), timeout=wait)
        ready.update(done)
        pending = {o: pending[o] for o in waiting if o not in ready}
    return [o for o in objects if o in ready]  # in their order


def get_silos(
    refs: Mapping[str, Any],
    handles: Mapping[str, Any],
    what: str,
    timeout: float,
    key: str = "round.call_timeout_s",
) -> list[Any]:
    """`get` of each silo's ref (silo -> the ref of its call on `handles[silo]`), each waited
    for `timeout` s times the silos of `refs` its worker holds, which it runs one after another
    (as `rounds.gather` waits for a packed worker's fits)."""
    shares = silos_in_call({name: handles[name] for name in refs})
    names = [f"silo {name}" for name in refs]
    return get(list(refs.values()), what, timeout, names, key, [shares[n] for n in refs])


def get(
    refs: Any,
    what: str,
    timeout: float | None = None,
    names: Sequence[str] = (),
    key: str = "round.call_timeout_s",
    shares: Sequence[int] = (),
) -> Any:
    """ray.get that surfaces a user error from an actor as itself, and anything else in one line.

    `names` says whose each of a list of refs is ("silo va"): a timeout names who did not answer,
    and `key`, the setting that gave `timeout`. `shares` says, for each ref, how many silos of
    this call its worker runs (see `get_silos`): that ref is waited for that many times `timeout`.
    """
    try:
        if shares and timeout is not None:
            ready = set(wait_each(dict(zip(refs, shares, strict=True)), timeout))
            if len(ready) < len(refs):
                raise FederationError(_no_answer(what, key, timeout, names, refs, ready, shares))
            timeout = None
        return ray.get(refs, timeout=timeout)
    except ray.exceptions.RayTaskError as exc:
        _collect_the_rest(refs)
        cause = task_error_cause(exc)
        if isinstance(cause, SiloPflError):
            raise cause from None
        first = scrub(str(cause).strip().splitlines()[-1]) if str(cause).strip() else ""
        raise FederationError(f"{what} failed: {type(cause).__name__}: {first}") from exc
    except ray.exceptions.GetTimeoutError:
        ready: set[Any] = set()
        if names and isinstance(refs, list):
            ready = set(ray.wait(refs, num_returns=len(refs), timeout=0)[0])
        message = _no_answer(what, key, timeout or 0.0, names, refs, ready, shares)
        raise FederationError(message) from None
    except ray.exceptions.RayActorError as exc:
        who = _ROLES.get(getattr(exc, "actor_id", None) or "", "an actor")
        raise FederationError(f"{what}: {who} died ({typed_line(exc)})") from exc


def _no_answer(
    what: str,
    key: str,
    timeout: float,
    names: Sequence[str],
    refs: Any,
    ready: set[Any],
    shares: Sequence[int],
) -> str:
    """The error of a wait past its deadline: who of `names` (one for each of `refs`) did not
    answer, each packed worker's with its deadline (`shares`)."""
    late = []
    if names and isinstance(refs, list):
        counts = shares or [1] * len(refs)
        for name, ref, k in zip(names, refs, counts, strict=True):
            packed = f" (its worker's calls for {k} silos: {k * timeout:g} s)" if k > 1 else ""
            if ref not in ready:
                late.append(name + packed)
    who = f" from {', '.join(late)}" if late else ""
    return f"{what}: no answer within {key}={timeout:g} s{who}"


def _collect_the_rest(refs: Any) -> None:
    """After one ref's error, fetch the others that are done, so that Ray does not log their
    errors again as unhandled once the refs are dropped."""
    if not isinstance(refs, list):
        return
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=1.0)
    for ref in ready:
        with contextlib.suppress(Exception):
            ray.get(ref)


def stop(actors: Sequence[Any], keep: bool = False, wait_gone: bool = False) -> None:
    """Stop actors (a silo's handle stops its worker); they hold no state the run still needs.
    With `keep` (the run ended well, and Ray outlives it) the workers that may serve the next
    run are closed and kept instead (runtime.host_pool); with `wait_gone`, the others are waited
    for until they are gone."""
    hosts = [a.host if isinstance(a, SiloHandle) else a for a in actors]
    unique = list({h._actor_id.hex(): h for h in hosts}.values())
    host_pool.release(unique, keep, wait_gone)
    for actor in unique:
        _ROLES.pop(actor._actor_id.hex(), None)
