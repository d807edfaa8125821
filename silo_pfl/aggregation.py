"""Aggregation of silo updates: the weighted mean of deltas, keyed by state_dict name."""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from functools import partial

import numpy as np
import torch

from silo_pfl.slices import CORES, for_slices

State = dict[str, np.ndarray]

SLICE = 1 << 15  # values: slices of a large key start at multiples of this
THREADED_VALUES = 1 << 18  # a key of at least this many values is shared out over the cores


def weighted_mean(deltas: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float]) -> State:
    """Per key, sum_i (w_i / sum_j w_j) * delta_i, in the given order.

    A floating-point key is accumulated in its own dtype by one fused multiply-add per value and
    update (torch's `add_(alpha=)`: one rounding each, the same result on any number of threads),
    so each delta is read once, in place, at memory speed. float32's relative error, about
    N * 6e-8 over N silos, is far below any update's noise. Integer keys (BatchNorm's batch
    counters) are accumulated in float64. A large key is cut into slices over the process's cores
    (`silo_pfl.slices`); the small keys go together, one call per update."""
    if not deltas:
        raise ValueError("no updates to aggregate")
    if len(deltas) != len(weights):
        raise ValueError(f"{len(deltas)} updates but {len(weights)} weights")
    total = float(sum(weights))
    if total <= 0 or min(weights) < 0:
        raise ValueError(f"weights must be >= 0 with a positive sum, got {list(weights)}")
    scales = [weight / total for weight in weights]
    with warnings.catch_warnings():  # Ray's store hands out read-only arrays; they are only read
        warnings.filterwarnings("ignore", "The given NumPy array is not writable", UserWarning)
        columns = {key: _flat_floats([delta[key] for delta in deltas]) for key in deltas[0]}
    means = {key: np.zeros(column[0].numel(), _dtype(column[0])) for key, column in columns.items()}
    small = [key for key, acc in means.items() if acc.size < THREADED_VALUES]
    _scaled_sums(
        [torch.from_numpy(means[key]) for key in small],
        [[columns[key][i] for key in small] for i in range(len(deltas))],
        scales,
    )
    for key in means.keys() - set(small):
        work = partial(_scaled_slice, torch.from_numpy(means[key]), columns[key], scales)
        for_slices(means[key].size, SLICE, CORES, work)
    return {key: means[key].reshape(np.shape(deltas[0][key])) for key in deltas[0]}


def _flat_floats(arrays: Sequence[np.ndarray]) -> list[torch.Tensor]:
    """Each array as a flat tensor over its own memory; integers as float64 copies."""
    flat = [np.asarray(a).reshape(-1) for a in arrays]
    if flat[0].dtype.kind != "f":
        flat = [a.astype(np.float64) for a in flat]
    return [torch.from_numpy(a) for a in flat]


def _dtype(tensor: torch.Tensor) -> np.dtype:
    return tensor[:0].numpy().dtype


def _scaled_sums(
    outs: list[torch.Tensor], updates: Sequence[list[torch.Tensor]], scales: Sequence[float]
) -> None:
    """outs[k] += scales[i] * updates[i][k] for each update i in order: one fused multiply-add per
    value (outs start at zero)."""
    if outs:
        for update, scale in zip(updates, scales, strict=True):
            torch._foreach_add_(outs, update, alpha=scale)


def _scaled_slice(
    flat: torch.Tensor, sources: list[torch.Tensor], scales: Sequence[float], first: int, end: int
) -> None:
    """`_scaled_sums` of one slice of a key."""
    _scaled_sums([flat[first:end]], [[source[first:end]] for source in sources], scales)


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
