"""Aggregation of silo updates: the weighted mean of deltas, keyed by state_dict name.

numpy only: the server process does not import torch. The weighted mean works the keys of one
dtype as one vector, block by block: each block of an update is read once from memory into a
temporary that stays in the core's cache, and a long vector is cut into slices over the
process's cores (`silo_pfl.slices`; numpy lets go of the GIL on each block). Every value is
worked on its own, so the bits depend neither on the blocks nor on the threads.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from silo_pfl.slices import CORES, fault_in, for_slices

State = dict[str, np.ndarray]

SLICE = 1 << 17  # values: slices of a long vector start at multiples of this (whole blocks)
THREADED_VALUES = 1 << 18  # a vector of at least this many values is shared out over the cores
BLOCK = 1 << 17  # values per step: a thread's temporary (512 KiB of float32) stays in L2


def weighted_mean(deltas: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float]) -> State:
    """Per key, sum_i (w_i / sum_j w_j) * delta_i, in the given order.

    A float32 key is accumulated in float32: acc = f32(acc + f32(scale * delta)), with scale =
    w_i / sum_j w_j rounded to float32, two roundings per value and update, the same on any
    number of threads. Its relative error, about 2N * 6e-8 over N silos, is far below any
    update's noise, and float32 arithmetic runs at memory speed where float64's would not. Every
    other key (float64, float16, BatchNorm's integer batch counters) is accumulated in float64,
    converted as it is read, and its mean is float64.

    The keys that accumulate in one dtype are laid end to end in one result vector (each key's
    mean is a view of it), worked `BLOCK` values at a time: for each block, each update in turn
    is scaled into a temporary (a block of several small keys is gathered into it first)
    and added, so the many small keys of a model cost a few numpy calls per block and update, not
    per key, and nothing of an update's size is allocated. Each delta is read once, where it is
    (Ray's read-only arrays are fine; the inputs are never written); a non-contiguous one is
    copied first. A vector of `THREADED_VALUES` values or more is cut into slices of whole
    blocks, one a thread, over the process's cores, its pages faulted in on this thread first
    (`slices.fault_in`)."""
    if not deltas:
        raise ValueError("no updates to aggregate")
    if len(deltas) != len(weights):
        raise ValueError(f"{len(deltas)} updates but {len(weights)} weights")
    total = float(sum(weights))
    if total <= 0 or min(weights) < 0:
        raise ValueError(f"weights must be >= 0 with a positive sum, got {list(weights)}")
    shapes = {key: np.shape(value) for key, value in deltas[0].items()}
    groups: dict[np.dtype, list[str]] = {}
    for key, value in deltas[0].items():
        groups.setdefault(_accumulator(np.asarray(value).dtype), []).append(key)
    means: State = {}
    for dtype, keys in groups.items():
        starts = [0, *itertools.accumulate(math.prod(shapes[key]) for key in keys)]
        flat = np.empty(starts[-1], dtype)  # the first update writes every value
        sources = [[np.asarray(delta[key]).reshape(-1) for key in keys] for delta in deltas]
        scales = [dtype.type(weight / total) for weight in weights]
        work = _blocks(flat, starts, sources, scales)
        if flat.size >= THREADED_VALUES:
            fault_in(flat)
            for_slices(flat.size, SLICE, CORES, work)
        else:
            work(0, flat.size)
        for key, first, end in zip(keys, starts, starts[1:], strict=False):
            means[key] = flat[first:end].reshape(shapes[key])
    return {key: means[key] for key in deltas[0]}


def _accumulator(dtype: np.dtype) -> np.dtype:
    """The dtype a key is accumulated in: float32 in float32 (numpy's fastest, at memory speed),
    any other in float64."""
    return dtype if dtype == np.float32 else np.dtype(np.float64)


def _blocks(
    flat: np.ndarray,
    starts: list[int],
    sources: list[list[np.ndarray]],
    scales: Sequence[np.floating],
) -> Callable[[int, int], None]:
    """work(first, end): flat[first:end] += scales[i] * (update i's keys laid end to end, as cut
    at `starts`)[first:end] for each update i in order, one block of `BLOCK` values after the
    other, through a temporary of the thread's own."""

    def work(first: int, end: int) -> None:
        temporary = np.empty(min(BLOCK, end - first), flat.dtype)
        for low in range(first, end, BLOCK):
            high = min(end, low + BLOCK)
            acc, tmp = flat[low:high], temporary[: high - low]
            pieces = _pieces(starts, low, high)
            for i, (update, scale) in enumerate(zip(sources, scales, strict=True)):
                out = tmp if i else acc  # the first update's product is the sum so far
                if len(pieces) == 1:
                    key, lo, hi = pieces[0]
                    np.multiply(update[key][lo:hi], scale, out=out, dtype=flat.dtype)
                else:
                    parts = [update[key][lo:hi] for key, lo, hi in pieces]
                    np.concatenate(parts, out=out, casting="same_kind")
                    np.multiply(out, scale, out=out)
                if i:
                    np.add(acc, tmp, out=acc)

    return work


def _pieces(starts: list[int], low: int, high: int) -> list[tuple[int, int, int]]:
    """(key, first, end) of each key's values in [low, high) of the keys laid end to end, cut at
    `starts`."""
    pieces = []
    key = bisect.bisect_right(starts, low) - 1
    while low < high:
        end = min(high, starts[key + 1])
        if end > low:
            pieces.append((key, low - starts[key], end - starts[key]))
        low = end
        key += 1
    return pieces


def apply_delta(state: Mapping[str, np.ndarray], delta: Mapping[str, np.ndarray]) -> State:
    """state + delta, stored in each entry's dtype, rounded once (integer buffers to the nearest
    integer): new arrays, the inputs are left as they are."""
    out: State = {}
    for key, value in state.items():
        step = np.asarray(delta[key])
        if np.issubdtype(value.dtype, np.integer):
            out[key] = np.rint(np.add(value, step, dtype=np.float64)).astype(value.dtype)
        elif step.dtype == value.dtype:
            out[key] = np.add(value, step)
        else:
            out[key] = np.add(value, step, out=np.empty_like(value), dtype=np.float64)
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
