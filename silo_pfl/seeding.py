"""The one seed, and every generator derived from it by name.

`derive_seed(seed, "shuffle", silo, round)` gives the same integer on every machine for the same
arguments, so partitioning, initialisation, shuffling and masks are all reproducible.
"""

from __future__ import annotations

import hashlib
import random

import numpy as np


def derive_seed(seed: int, *names: object) -> int:
    """A 63-bit seed for the purpose `names`, derived from the federation seed."""
    text = "/".join([str(seed), *map(str, names)]).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little") >> 1


def numpy_rng(seed: int, *names: object) -> np.random.Generator:
    """A numpy generator for the purpose `names`."""
    return np.random.default_rng(derive_seed(seed, *names))


def seed_everything(seed: int) -> None:
    """Seed Python's, numpy's and torch's global generators in this process."""
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
