"""numpy's global generator (`np.random.*`), set aside and put back cheaply.

numpy's documented way, `np.random.get_state` and `set_state`, copies the MT19937 generator's 624
words one by one in Python, paid on every call into a packed silo. Those words and their position
are 2,500 bytes in the bit generator's memory, read and written here directly. The rest of the
legacy state is one cached Gaussian (`has_gauss`, `gauss`), which only `get_state` shows. A
Gaussian is cached only by drawing Gaussians, which consumes words: so words equal to those of a
moment when no Gaussian was cached prove that none is cached now, and only then are the words alone
taken. In every other case (a cached Gaussian, another bit generator) the documented calls do it,
exactly as before.
"""

from __future__ import annotations

import ctypes
import sys
from typing import Any

import numpy as np

_WORDS = 624
_BYTES = 4 * _WORDS + 4  # numpy's mt19937_state: uint32_t key[624]; int pos

# (the bit generator, its words) at a moment it held no cached Gaussian: the proof above.
_clean: tuple[Any, bytes] | None = None


def _mt19937() -> Any | None:
    """The global generator's MT19937, or None if something replaced it with another kind."""
    generator = np.random.get_bit_generator()
    return generator if type(generator) is np.random.MT19937 else None


def _words(generator: Any) -> bytes:
    return ctypes.string_at(generator.ctypes.state_address, _BYTES)


def _remember(state: Any) -> None:
    """After `state` was read or set the documented way: its words, if it caches no Gaussian."""
    global _clean
    generator = _mt19937()
    clean = generator is not None and isinstance(state, tuple) and state[3] == 0
    _clean = (generator, _words(generator)) if clean else None


def get() -> tuple[str, Any]:
    """The global generator's state: ("words", its 2,500 bytes) when no Gaussian is cached,
    else ("state", what `np.random.get_state` gives)."""
    generator = _mt19937()
    if generator is not None and _clean is not None and _clean[0] is generator:
        words = _words(generator)
        if words == _clean[1]:
            return "words", words
    state = np.random.get_state(legacy=generator is not None)
    _remember(state)
    return ("words", _clean[1]) if _clean is not None else ("state", state)


def put(token: tuple[str, Any]) -> None:
    """Make the global generator's state what `get` gave."""
    global _clean
    kind, value = token
    generator = _mt19937()
    if kind == "words" and generator is not None:
        ctypes.memmove(generator.ctypes.state_address, value, _BYTES)
        np.random.set_bit_generator(generator)  # the same generator again: no cached Gaussian
        _clean = (generator, value)
        return
    state = legacy(token)
    np.random.set_state(state)
    _remember(state)


def legacy(token: tuple[str, Any]) -> Any:
    """`token` as `np.random.get_state` would have given it."""
    kind, value = token
    if kind != "words":
        return value
    keys = np.frombuffer(value, dtype=np.uint32, count=_WORDS).copy()
    return "MT19937", keys, int.from_bytes(value[-4:], sys.byteorder, signed=True), 0, 0.0
