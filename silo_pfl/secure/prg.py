"""Masks: AES-256 in counter mode, keyed by a full 256-bit secret, added in place.

Each key masks one vector once (keys are derived per round, attempt and pair), so a fixed
counter start is never reused. The vector is walked block by block, and every key's stream for
a block is added while that block is in cache: the cost is the cipher's, not memory traffic.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

BLOCK_WORDS = 1 << 14  # 128 KiB of key stream at a time
_ZEROS = bytes(8 * BLOCK_WORDS)
_COUNTER = bytes(16)


def apply_streams(
    vector: np.ndarray, keys: Sequence[tuple[bytes, int]], plus: Sequence[np.ndarray] = ()
) -> None:
    """vector += sum(plus) + sign * stream(key) for every (key, sign), modulo 2^64, in place;
    a sign is +1 or -1."""
    for key, sign in keys:
        if len(key) != 32 or sign not in (1, -1):
            raise ValueError("a mask key has 32 bytes and a sign of +1 or -1")
    ciphers = [
        (Cipher(algorithms.AES(key), modes.CTR(_COUNTER)).encryptor(), sign) for key, sign in keys
    ]
    buffer = bytearray(8 * BLOCK_WORDS + 15)
    for start in range(0, vector.size, BLOCK_WORDS):
        count = min(BLOCK_WORDS, vector.size - start)
        block = vector[start : start + count]
        words = np.frombuffer(buffer, dtype="<u8", count=count)
        zeros = _ZEROS if count == BLOCK_WORDS else _ZEROS[: 8 * count]
        for other in plus:
            np.add(block, other[start : start + count], out=block)
        for encryptor, sign in ciphers:
            encryptor.update_into(zeros, buffer)
            if sign > 0:
                np.add(block, words, out=block)
            else:
                np.subtract(block, words, out=block)


def apply_stream(vector: np.ndarray, key: bytes, sign: int) -> None:
    """vector += sign * stream(key) modulo 2^64, in place."""
    apply_streams(vector, [(key, sign)])


def stream(key: bytes, length: int) -> np.ndarray:
    """`length` uniformly random uint64 words from `key` (what `apply_stream` adds)."""
    words = np.zeros(length, dtype=np.uint64)
    apply_stream(words, key, +1)
    return words
