"""Masks: AES-256 in counter mode, keyed by a full 256-bit secret, added in place.

The stream is AES-256's counter mode as GCM runs it (GCTR, NIST SP 800-38D), its tag never
computed: the vector is cut into chunks of CHUNK_WORDS words, and chunk c's words are AES-256-GCM's
encryption of zeros under the 96-bit nonce c, that is AES-256(key, c || i) for i = 2, 3, ...:
every counter block under a key is distinct. Each key masks one vector once (keys are derived
per round, attempt and pair).

OpenSSL can make these words two ways, byte for byte the same: as GCM's ciphertext, or as its
CTR mode from the counter block c || 2 (a chunk's 32-bit counter never wraps, so CTR's 128-bit
increment is GCM's). Which is faster depends on the CPU (docs/BENCHMARKS.md, "Secure
aggregation"), so each process times both once, on a few blocks, and uses the faster (`engine`).
The masks do not depend on the choice.

The vector is walked block by block, and every key's stream for a block is added while that block
is in cache: the cost is the cipher's, not memory traffic. The cipher and numpy's additions
release the GIL, so the server, which the silos wait for, removes masks on several threads: a
slice of whole chunks each.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from functools import cache, partial

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, CipherContext, algorithms, modes

from silo_pfl.slices import for_slices

BLOCK_WORDS = 1 << 14  # 128 KiB of key stream at a time
CHUNK_WORDS = 1 << 18  # 2 MiB of key stream under one nonce; a whole number of blocks
NONCE_BYTES = 12
FIRST_COUNTER = (2).to_bytes(4, "big")  # GCM's first counter block for its data: nonce || 2
_ZEROS = bytes(8 * BLOCK_WORDS)
assert 2 + CHUNK_WORDS * 8 // 16 < 2**32  # a chunk's counter stays in its low 32 bits


def _gcm(key: bytes, nonce: bytes) -> CipherContext:
    return Cipher(algorithms.AES(key), modes.GCM(nonce)).encryptor()


def _ctr(key: bytes, nonce: bytes) -> CipherContext:
    return Cipher(algorithms.AES(key), modes.CTR(nonce + FIRST_COUNTER)).encryptor()


ENGINES: dict[str, Callable[[bytes, bytes], CipherContext]] = {"gcm": _gcm, "ctr": _ctr}
CALIBRATION_BLOCKS = 8  # 1 MiB of key stream per engine and try, about 1 ms


def faster(seconds: Callable[[str], float], tries: int = 3) -> str:
    """The engine with the least of `tries` timings by `seconds`, tried in turn (ties: GCM)."""
    best = dict.fromkeys(ENGINES, float("inf"))
    for _ in range(tries):
        for name in ENGINES:
            best[name] = min(best[name], seconds(name))
    return min(ENGINES, key=lambda name: best[name])


def _cpu_seconds(name: str) -> float:
    """This thread's CPU time for CALIBRATION_BLOCKS blocks of `name`'s key stream."""
    buffer, start = bytearray(8 * BLOCK_WORDS + 15), time.thread_time()
    encryptor = ENGINES[name](bytes(32), bytes(NONCE_BYTES))
    for _ in range(CALIBRATION_BLOCKS):
        encryptor.update_into(_ZEROS, buffer)
    return time.thread_time() - start


@cache
def engine() -> str:
    """The faster engine on this CPU, timed once per process."""
    return faster(_cpu_seconds)


def _apply_slice(
    encryptor_of: Callable[[bytes, bytes], CipherContext],
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
            ciphers = [(encryptor_of(key, nonce), sign) for key, sign in keys]
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
    work = partial(_apply_slice, ENGINES[engine()], vector, keys, plus)
    for_slices(vector.size, CHUNK_WORDS, threads, work)


def apply_stream(vector: np.ndarray, key: bytes, sign: int) -> None:
    """vector += sign * stream(key) modulo 2^64, in place."""
    apply_streams(vector, [(key, sign)])


def stream(key: bytes, length: int) -> np.ndarray:
    """`length` uniformly random uint64 words from `key` (what `apply_stream` adds)."""
    words = np.zeros(length, dtype=np.uint64)
    apply_stream(words, key, +1)
    return words
