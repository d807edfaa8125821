"""Secure aggregation by pairwise masking (Bonawitz et al., 2017, without dropout recovery).

Each silo holds an X25519 key pair; the private key never leaves its process. Every pair of
silos derives a shared key (X25519, then HKDF-SHA256 bound to the federation and the two names),
and from it a fresh ChaCha20 key stream each round. A silo encodes its weighted update
(num_examples * delta, in fixed point) and its weight as one vector of integers modulo 2^64,
adds the stream it shares with every peer named after it and subtracts the stream it shares with
every peer named before it. Each masked vector alone is uniformly random to the server; in the
sum of all silos' vectors the masks cancel exactly, leaving sum(n_i * delta_i) and sum(n_i), so
the server learns the weighted mean and nothing about any single silo.

Threat model: an honest-but-curious server that follows the protocol. The public keys are
relayed by the driver unauthenticated, so a malicious driver could stand in the middle; every
silo must take part in every round: a round that loses one is tried again as a whole, with masks
derived afresh for the new attempt, so that no mask is ever used twice.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
)

from silo_pfl.errors import FederationError

FRACTION_BITS = 24  # fixed point: a value v is sent as round(v * 2^24) modulo 2^64
_SCALE = float(1 << FRACTION_BITS)
_ZERO_NONCE = bytes(16)  # every key stream has its own key, so a fixed nonce is never reused


def _hkdf(secret: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(secret)


def _stream(key: bytes, length: int) -> np.ndarray:
    """`length` uniformly random uint64 values from ChaCha20 under `key`."""
    encryptor = Cipher(algorithms.ChaCha20(key, _ZERO_NONCE), mode=None).encryptor()
    return np.frombuffer(encryptor.update(bytes(8 * length)), dtype="<u8").astype(np.uint64)


def encode(payload: Mapping[str, np.ndarray], weight: int, parties: int = 1) -> np.ndarray:
    """weight * payload (keys in sorted order, flattened) in fixed point, then weight: uint64.

    Each value must stay below 2^62 / parties in fixed point, so the sum over `parties` silos
    cannot overflow.
    """
    values = [np.asarray(payload[k], dtype=np.float64).ravel() for k in sorted(payload)]
    flat = np.concatenate([*values, np.zeros(0)]) * weight
    fixed = np.rint(flat * _SCALE)
    if fixed.size and not np.all(np.abs(fixed) < 2.0**62 / parties):
        raise OverflowError("a weighted update is too large for secure aggregation's fixed point")
    return np.append(fixed.astype(np.int64), np.int64(weight)).view(np.uint64)


def decode_mean(total: np.ndarray, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """From the sum of every silo's vector, sum(w_i * x_i) / sum(w_i) per key (float64)."""
    signed = total.view(np.int64)
    weight = int(signed[-1])
    if weight < 1:
        raise ValueError(f"secure aggregation: the weights sum to {weight}, expected >= 1")
    flat = signed[:-1].astype(np.float64)
    flat /= _SCALE
    flat /= weight
    mean, start = {}, 0
    for key in sorted(shapes):
        size = int(np.prod(shapes[key], dtype=np.int64))
        mean[key] = flat[start : start + size].reshape(shapes[key])
        start += size
    if start != flat.size:
        raise ValueError(f"secure aggregation: {flat.size} values for {start} expected")
    return mean


def vector_length(shapes: Mapping[str, tuple[int, ...]]) -> int:
    """Entries in one masked vector: every global value, then the weight."""
    return sum(int(np.prod(shape, dtype=np.int64)) for shape in shapes.values()) + 1


def masked_sum(vectors: Sequence[np.ndarray]) -> np.ndarray:
    """The sum of the silos' masked vectors modulo 2^64; the masks cancel here."""
    total = np.zeros_like(vectors[0])
    for vector in vectors:
        total += vector  # uint64 arithmetic wraps: addition modulo 2^64
    return total


class Masker:
    """One silo's side: its key pair, the keys it shares with its peers, and its masks."""

    def __init__(self, federation: str, silo: str, private: bytes | None = None) -> None:
        self.federation, self.silo = federation, silo
        self._private = (
            X25519PrivateKey.from_private_bytes(private) if private else X25519PrivateKey.generate()
        )
        self._pair_keys: dict[str, bytes] = {}

    def private_bytes(self) -> bytes:
        """The raw private key, for the silo's own directory only (resume after a restart)."""
        return self._private.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())

    def public_key(self) -> bytes:
        """This silo's X25519 public key, 32 raw bytes; the only thing it publishes."""
        return self._private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)

    def pair_with(self, public_keys: Mapping[str, bytes]) -> None:
        """Derive a shared key with every other silo from the published public keys."""
        if public_keys.get(self.silo) != self.public_key():
            raise FederationError(f"silo {self.silo}: its own public key is missing or altered")
        peers = {name: key for name, key in public_keys.items() if name != self.silo}
        if not peers:
            raise FederationError(f"silo {self.silo}: secure aggregation needs at least 2 silos")
        self._pair_keys = {}
        for peer, key in sorted(peers.items()):
            try:
                secret = self._private.exchange(X25519PublicKey.from_public_bytes(key))
            except ValueError as exc:
                raise FederationError(f"silo {peer}: unusable public key ({exc})") from None
            first, second = sorted((self.silo, peer))
            info = f"silo_pfl secure aggregation|{self.federation}|{first}|{second}".encode()
            self._pair_keys[peer] = _hkdf(secret, info)

    def mask(
        self, payload: Mapping[str, np.ndarray], weight: int, round_: int, attempt: int = 1
    ) -> np.ndarray:
        """The encoded update plus the streams shared with later peers, minus earlier peers'.

        Each (round, attempt) has its own streams: a retried round never reuses a mask."""
        if not self._pair_keys:
            raise FederationError(f"silo {self.silo}: mask() before pair_with()")
        try:
            vector = encode(payload, weight, parties=len(self._pair_keys) + 1)
        except OverflowError as exc:
            raise FederationError(f"silo {self.silo}: {exc}") from None
        for peer, key in self._pair_keys.items():
            info = f"round {round_} attempt {attempt}".encode()
            stream = _stream(_hkdf(key, info), vector.size)
            if self.silo < peer:
                vector += stream
            else:
                vector -= stream
        return vector
