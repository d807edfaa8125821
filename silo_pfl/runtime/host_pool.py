"""Worker processes kept warm between the runs of one Ray session.

A run that starts its own Ray stops it at its end, and its workers with it. A process that keeps
one Ray up across runs (the Python API in a notebook or a sweep, `silo-pfl compare`'s workers,
the test suite) gives a finished run's workers back here instead, and the next run opens its
silos (or its server) in one with the same actor options: no new process, no new torch import
(seconds of CPU a worker). A worker is kept only when it is closed (it holds no run's state),
reserves no resources and recorded no live metrics (its figures end with its run); at most
`KEEP` are kept, the others stopped.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import ray

KEEP = 4  # idle workers kept in all
READY_TIMEOUT_S = 5.0  # a kept worker that does not answer this soon is stopped, not used
CLOSE_TIMEOUT_S = 10.0  # a worker that cannot close this soon (hung, stopped) is not kept
GONE_TIMEOUT_S = 5.0  # how long a failed run waits for its killed actors to be gone

_idle: dict[str, list[Any]] = {}  # options key -> idle workers
_keys: dict[str, str] = {}  # actor id (hex) -> its options key, for workers that may be kept
_session: list[tuple[str, str]] = []  # the Ray session the idle workers belong to


def _key(cls: type, options: dict[str, Any]) -> str | None:
    """The pool's key for workers of `cls` started with `options`; None if they reserve
    resources, and so are never kept idle."""
    if options.get("num_cpus") or options.get("resources"):
        return None
    return json.dumps([cls.__name__, options], sort_keys=True, default=str)


def _this_session() -> tuple[str, str]:
    context = ray.get_runtime_context()
    return context.gcs_address, context.get_job_id()


def start(cls: type, options: dict[str, Any], keep: bool) -> Any:
    """A worker of `cls` with `options`: an idle one of this session when `keep` allows it
    (later given back by `release`), else a new one. Either way still to be opened."""
    key = _key(cls, options) if keep else None
    if key is not None:
        if _session != [_this_session()]:
            _idle.clear()
            _session[:] = [_this_session()]
        idle = _idle.get(key, [])
        while idle:
            worker = idle.pop()
            if _alive(worker):
                _keys[worker._actor_id.hex()] = key
                return worker
            ray.kill(worker, no_restart=True)
    worker = ray.remote(cls).options(**options).remote()
    if key is not None:
        _keys[worker._actor_id.hex()] = key
    return worker


def _alive(worker: Any) -> bool:
    """Whether an idle `worker` answers within READY_TIMEOUT_S. A dead actor's call is ready
    too (it fails at once), so the answer is read, not only waited for."""
    ref = worker.__ray_ready__.remote()
    ready, _ = ray.wait([ref], timeout=READY_TIMEOUT_S)
    return bool(ready) and _answered(ref)


def release(workers: Sequence[Any], keep: bool, wait_gone: bool = False) -> None:
    """A run's end: close the workers that may be kept (while `keep`, as long as this Ray
    session lasts) and keep them idle, up to KEEP; stop all others. With `wait_gone`, wait (up
    to GONE_TIMEOUT_S) until those are gone: what they were about to write then cannot come
    after the caller's clean-up (a failed fresh run's directory, deleted next)."""
    keepable = [w for w in workers if w._actor_id.hex() in _keys] if keep else []
    closing = {w._actor_id.hex(): w.close.remote() for w in keepable}
    ready, _ = ray.wait(list(closing.values()), num_returns=len(closing), timeout=CLOSE_TIMEOUT_S)
    idle = sum(len(v) for v in _idle.values())
    killed = []
    for worker in workers:
        key = _keys.pop(worker._actor_id.hex(), None)
        ref = closing.get(worker._actor_id.hex())
        if key is not None and ref in ready and idle < KEEP and _answered(ref):
            _idle.setdefault(key, []).append(worker)
            idle += 1
        else:
            ray.kill(worker, no_restart=True)
            if wait_gone:
                killed.append(worker.__ray_ready__.remote())
    if wait_gone:  # a dead actor's call fails as soon as Ray knows it is dead
        ray.wait(killed, num_returns=len(killed), timeout=GONE_TIMEOUT_S)


def _answered(ref: Any) -> bool:
    """Whether the call `ref` returned, not an error (its actor died, or it raised)."""
    try:
        ray.get(ref)
    except ray.exceptions.RayError:
        return False
    return True


def drain() -> None:
    """Stop every idle worker (a benchmark's or a test's clean slate)."""
    idle = [worker for workers in _idle.values() for worker in workers]
    _idle.clear()
    release(idle, keep=False)
