"""Masks: AES-256 in counter mode, keyed by a full 256-bit secret, added in place.

Each key masks one vector once (keys are derived per round, attempt and pair), so a fixed
counter start is never reused. The stream is made in blocks small enough to stay in cache.
"""

from __future__ import annotations

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

BLOCK_WORDS = 1 << 14  # 128 KiB of key stream at a time
_ZEROS = bytes(8 * BLOCK_WORDS)
_COUNTER = bytes(16)


def apply_stream(vector: np.ndarray, key: bytes, sign: int) -> None:
    """vector += sign * stream(key) modulo 2^64, in place; `sign` is +1 or -1."""
    if len(key) != 32:
        raise ValueError("a mask key has 32 bytes")
    encryptor = Cipher(algorithms.AES(key), modes.CTR(_COUNTER)).encryptor()
    buffer = bytearray(8 * BLOCK_WORDS + 15)
    combine = np.add if sign > 0 else np.subtract
    for start in range(0, vector.size, BLOCK_WORDS):
        count = min(BLOCK_WORDS, vector.size - start)
        encryptor.update_into(_ZEROS[: 8 * count], buffer)
        block = vector[start : start + count]
        combine(block, np.frombuffer(buffer, dtype="<u8", count=count), out=block)


def stream(key: bytes, length: int) -> np.ndarray:
    """`length` uniformly random uint64 words from `key` (what `apply_stream` adds)."""
    words = np.zeros(length, dtype=np.uint64)
    apply_stream(words, key, +1)
    return words
