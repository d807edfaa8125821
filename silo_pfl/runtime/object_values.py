"""Values of ready Ray objects, where a dead actor or a failed call is a value too. No torch, so
that the server's process can use it (`runtime.server_host`)."""

from __future__ import annotations

from typing import Any

import ray

FAILURES = (ray.exceptions.RayActorError, ray.exceptions.RayTaskError)


def get_each(refs: list[Any]) -> list[Any]:
    """Each ready ref's value, or the actor's death or task error it raises instead: one call
    for them all (each call costs its caller), a call each only when one of them raises."""
    try:
        return ray.get(refs)
    except FAILURES:
        values = []
        for ref in refs:
            try:
                values.append(ray.get(ref))
            except FAILURES as exc:
                values.append(exc)
        return values
