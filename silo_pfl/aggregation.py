"""Aggregation of silo updates: the weighted mean of deltas, keyed by state_dict name."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

State = dict[str, np.ndarray]


def weighted_mean(deltas: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float]) -> State:
    """Per key, sum_i w_i * delta_i / sum_i w_i, accumulated in float64 in the given order."""
    if not deltas:
        raise ValueError("no updates to aggregate")
    if len(deltas) != len(weights):
        raise ValueError(f"{len(deltas)} updates but {len(weights)} weights")
    total = float(sum(weights))
    if total <= 0 or min(weights) < 0:
        raise ValueError(f"weights must be >= 0 with a positive sum, got {list(weights)}")
    mean: State = {}
    for key in deltas[0]:
        acc = np.zeros(np.shape(deltas[0][key]), dtype=np.float64)
        for delta, weight in zip(deltas, weights, strict=True):
            acc += (weight / total) * np.asarray(delta[key], dtype=np.float64)
        mean[key] = acc
    return mean


def apply_delta(state: Mapping[str, np.ndarray], delta: Mapping[str, np.ndarray]) -> State:
    """state + delta, cast back to each entry's dtype (integer buffers are rounded)."""
    out: State = {}
    for key, value in state.items():
        updated = value.astype(np.float64) + delta[key]
        if np.issubdtype(value.dtype, np.integer):
            updated = np.rint(updated)
        out[key] = updated.astype(value.dtype)
    return out


def flatten(
    delta: Mapping[str, np.ndarray], extras: Mapping[str, Mapping[str, np.ndarray]]
) -> State:
    """One mapping of an update's delta and its named extras ('<extra>/<key>'), so that both are
    aggregated (and masked) as one."""
    flat = dict(delta)
    for name, values in extras.items():
        flat.update({f"{name}/{key}": value for key, value in values.items()})
    return flat


def unflatten(
    flat: Mapping[str, np.ndarray], extras: Sequence[str]
) -> tuple[State, dict[str, State]]:
    """Split what `flatten` made back into the delta and the named extras."""
    delta: State = {k: v for k, v in flat.items() if "/" not in k}
    named: dict[str, State] = {name: {} for name in extras}
    for key, value in flat.items():
        name, sep, rest = key.partition("/")
        if sep:
            named[name][rest] = value
    return delta, named
