"""Aggregation of silo updates: the weighted mean of deltas, keyed by state_dict name."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial

import numpy as np

from silo_pfl.slices import CORES, for_slices

State = dict[str, np.ndarray]

# Elements per block of the weighted mean: a block's float64 accumulator and scratch (512 KiB
# together) stay in cache while every update's block is added into it.
BLOCK = 1 << 15
THREADED_BLOCKS = 8  # a key of at least this many blocks is shared out over the cores


def weighted_mean(deltas: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float]) -> State:
    """Per key, sum_i (w_i / sum_j w_j) * delta_i, accumulated in float64 in the given order.

    Block by block: each update's block is scaled (in float64, in one pass) into one reused
    scratch block and added to the accumulator's block while both are in cache, so the deltas
    are read once, in place, and nothing the size of a delta is allocated but the result. A large
    key's blocks are shared out over the process's cores (`silo_pfl.slices`): each block is
    computed alone, so the result is the same on any number of threads."""
    if not deltas:
        raise ValueError("no updates to aggregate")
    if len(deltas) != len(weights):
        raise ValueError(f"{len(deltas)} updates but {len(weights)} weights")
    total = float(sum(weights))
    if total <= 0 or min(weights) < 0:
        raise ValueError(f"weights must be >= 0 with a positive sum, got {list(weights)}")
    scales = [weight / total for weight in weights]
    mean: State = {}
    for key in deltas[0]:
        acc = np.zeros(np.shape(deltas[0][key]), dtype=np.float64)
        flat = acc.reshape(-1)
        sources = [np.asarray(delta[key]).reshape(-1) for delta in deltas]
        threads = CORES if flat.size >= THREADED_BLOCKS * BLOCK else 1
        for_slices(flat.size, BLOCK, threads, partial(_add_scaled, flat, sources, scales))
        mean[key] = acc
    return mean


def _add_scaled(
    flat: np.ndarray, sources: Sequence[np.ndarray], scales: Sequence[float], first: int, end: int
) -> None:
    """flat[first:end] += sum_i scales[i] * sources[i][first:end], block by block, in order."""
    scratch = np.empty(min(BLOCK, end - first), dtype=np.float64)
    for start in range(first, end, BLOCK):
        block = flat[start : min(start + BLOCK, end)]
        scaled = scratch[: block.size]
        for source, scale in zip(sources, scales, strict=True):
            np.multiply(source[start : start + block.size], scale, out=scaled, dtype=np.float64)
            block += scaled


def apply_delta(state: Mapping[str, np.ndarray], delta: Mapping[str, np.ndarray]) -> State:
    """state + delta, added in float64 and stored in each entry's dtype (integer buffers are
    rounded): new arrays, the inputs are left as they are."""
    out: State = {}
    for key, value in state.items():
        if np.issubdtype(value.dtype, np.integer):
            out[key] = np.rint(np.add(value, delta[key], dtype=np.float64)).astype(value.dtype)
        else:
            out[key] = np.add(value, delta[key], out=np.empty_like(value), dtype=np.float64)
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
