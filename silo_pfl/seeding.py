"""The one seed, and every generator derived from it by name.

`derive_seed(seed, "shuffle", silo, round)` gives the same integer on every machine for the same
arguments, so partitioning, initialisation, shuffling and masks are all reproducible.
"""

from __future__ import annotations

import array
import hashlib
import random

import numpy as np

from silo_pfl import numpy_generator


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


def generators() -> tuple[object, object, object]:
    """Python's, numpy's and torch's global generator states, in their cheapest form (numpy's:
    `numpy_generator.get`): the way to set a process's generators aside and back
    (`set_generators`), not to save."""
    import torch

    return random.getstate(), numpy_generator.get(), torch.get_rng_state()


def set_generators(states: tuple[object, object, object]) -> None:
    """Put back what `generators` set aside."""
    import torch

    python, numpy, torch_state = states
    random.setstate(python)  # type: ignore[arg-type]
    numpy_generator.put(numpy)  # type: ignore[arg-type]
    torch.set_rng_state(torch_state)  # type: ignore[arg-type]


def rng_state() -> dict[str, object]:
    """Python's, numpy's and torch's global generator states, as checkpointable values: each
    generator's words as bytes, so that a checkpoint pickles a dozen plain objects, neither 625
    ints nor tensors (torch's pickler spends microseconds on each object it sees)."""
    import torch

    version, words, gauss_next = random.getstate()
    kind, keys, pos, has_gauss, gauss = numpy_generator.legacy(numpy_generator.get())
    return {
        "python": [version, array.array("I", words).tobytes(), gauss_next],  # numpy's: 2x slower
        "numpy": [kind, keys.astype(np.uint32).tobytes(), pos, has_gauss, gauss],
        "torch": torch.get_rng_state().numpy().tobytes(),
    }


def set_rng_state(state: dict[str, object]) -> None:
    """Restore what `rng_state` captured."""
    import torch

    version, words, gauss_next = state["python"]  # type: ignore[misc]
    random.setstate((version, tuple(np.frombuffer(words, np.uint32).tolist()), gauss_next))
    kind, keys, pos, has_gauss, gauss = state["numpy"]  # type: ignore[misc]
    numpy_state = (kind, np.frombuffer(keys, np.uint32).copy(), pos, has_gauss, gauss)
    numpy_generator.put(("state", numpy_state))
    torch.set_rng_state(torch.frombuffer(bytearray(state["torch"]), dtype=torch.uint8))  # type: ignore[arg-type]
