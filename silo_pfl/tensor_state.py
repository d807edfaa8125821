"""A model's state as a silo hands it around: tensors and numpy arrays over the same memory,
its size, its digest, and the check for a diverged state."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch


def as_arrays(state: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """Tensors as numpy arrays over the same memory, for `checkpoint.save_arrays`."""
    return {k: v.detach().numpy() for k, v in state.items()}


def as_tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """What a checkpoint gave back (numpy arrays, or tensors from an older run's torch
    checkpoint) as tensors, over the same memory."""
    return {k: torch.as_tensor(v) for k, v in state.items()}


def nbytes(arrays: dict[str, Any]) -> int:
    """The bytes of a mapping of arrays (global keys, a strategy's broadcast)."""
    return int(sum(np.asarray(v).nbytes for v in arrays.values()))


def local_digest(state: dict[str, torch.Tensor], keys: list[str] | tuple[str, ...]) -> str:
    """SHA-256 over the named tensors' bytes, in key order: proves two states equal bit for bit."""
    digest = hashlib.sha256()
    for key in sorted(keys):
        digest.update(key.encode())
        digest.update(state[key].detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def first_not_finite(state: dict[str, torch.Tensor]) -> str | None:
    """The first key whose tensor holds a NaN or an infinity, or None. A sum is finite only if
    every value is (a NaN or an infinity carries through it), so one check of the sum of every
    tensor's sum answers for them all, far cheaper than `isfinite(...).all()` on each. The exact
    test runs key by key only where that sum is not finite, from divergence or from an overflow
    of finite values."""
    sums = [value.sum() for value in state.values()]
    if not sums or bool(torch.isfinite(torch.stack(sums).sum())):
        return None
    for key, value in state.items():
        if not bool(torch.isfinite(value).all()):
            return key
    return None
