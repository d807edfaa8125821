"""Masks: AES-256 in counter mode, keyed by a full 256-bit secret, added in place.

The stream is AES-256's counter mode as GCM runs it (GCTR, NIST SP 800-38D), its tag never
computed: the vector is cut into chunks of CHUNK_WORDS words, and chunk c's words are AES-256-GCM's
encryption of zeros under the 96-bit nonce c, that is AES-256(key, c || i) for i = 2, 3, ...:
every counter block under a key is distinct. OpenSSL runs GCM with the CPU's vector AES
instructions where it has them, about twice as fast as its plain CTR mode on these machines
(`benchmarks/secure_aggregation.py --sections prg`). Each key masks one vector once (keys are
derived per round, attempt and pair).

The vector is walked block by block, and every key's stream for a block is added while that block
is in cache: the cost is the cipher's, not memory traffic. The cipher and numpy's additions
release the GIL, so the server, which the silos wait for, removes masks on several threads: a
slice of whole chunks each.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, CipherContext, algorithms, modes

from silo_pfl.slices import for_slices

BLOCK_WORDS = 1 << 14  # 128 KiB of key stream at a time
CHUNK_WORDS = 1 << 18  # 2 MiB of key stream under one nonce; a whole number of blocks
NONCE_BYTES = 12
_ZEROS = bytes(8 * BLOCK_WORDS)


def _apply_slice(
    vector: np.ndarray,
    keys: Sequence[tuple[bytes, int]],
    plus: Sequence[np.ndarray],
    first: int,
    end: int,
) -> None:
    """apply_streams on vector[first:end]; `first` is a multiple of CHUNK_WORDS."""
    buffer = bytearray(8 * BLOCK_WORDS + 15)
    ciphers: list[tuple[CipherContext, int]] = []
    for start in range(first, end, BLOCK_WORDS):
        if start % CHUNK_WORDS == 0:
            nonce = (start // CHUNK_WORDS).to_bytes(NONCE_BYTES, "big")
            ciphers = [
                (Cipher(algorithms.AES(key), modes.GCM(nonce)).encryptor(), sign)
                for key, sign in keys
            ]
        count = min(BLOCK_WORDS, end - start)
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


def apply_streams(
    vector: np.ndarray,
    keys: Sequence[tuple[bytes, int]],
    plus: Sequence[np.ndarray] = (),
    threads: int = 1,
) -> None:
    """vector += sum(plus) + sign * stream(key) for every (key, sign), modulo 2^64, in place;
    a sign is +1 or -1. With `threads` > 1 the vector is cut into that many slices, each done
    on its own thread: the same words, sooner where cores are free."""
    for key, sign in keys:
        if len(key) != 32 or sign not in (1, -1):
            raise ValueError("a mask key has 32 bytes and a sign of +1 or -1")
    for_slices(vector.size, CHUNK_WORDS, threads, partial(_apply_slice, vector, keys, plus))


def apply_stream(vector: np.ndarray, key: bytes, sign: int) -> None:
    """vector += sign * stream(key) modulo 2^64, in place."""
    apply_streams(vector, [(key, sign)])


def stream(key: bytes, length: int) -> np.ndarray:
    """`length` uniformly random uint64 words from `key` (what `apply_stream` adds)."""
    words = np.zeros(length, dtype=np.uint64)
    apply_stream(words, key, +1)
    return words
