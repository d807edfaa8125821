"""Shamir's t-of-n secret sharing of 32-byte secrets over the prime field GF(2^521 - 1)."""

from __future__ import annotations

import functools
import secrets
from collections.abc import Mapping, Sequence

PRIME = 2**521 - 1  # a Mersenne prime above every 256-bit secret
SHARE_BYTES = 66


def split(secret: bytes, threshold: int, xs: Sequence[int]) -> dict[int, int]:
    """Shares of `secret` at the points `xs` (distinct, >= 1); any `threshold` recover it."""
    if not 1 <= threshold <= len(xs):
        raise ValueError(f"threshold {threshold} for {len(xs)} shares")
    coefficients = [int.from_bytes(secret, "big")]
    coefficients += [secrets.randbelow(PRIME) for _ in range(threshold - 1)]
    shares = {}
    for x in xs:
        value = 0
        for coefficient in reversed(coefficients):
            value = (value * x + coefficient) % PRIME
        shares[x] = value
    return shares


@functools.lru_cache(maxsize=64)
def lagrange_at_zero(xs: tuple[int, ...]) -> tuple[int, ...]:
    """The weights that turn the values at `xs` of a polynomial into its value at 0 (cached:
    under a full mesh every secret of a round is recovered from the same points)."""
    weights = []
    for i, xi in enumerate(xs):
        numerator, denominator = 1, 1
        for j, xj in enumerate(xs):
            if i != j:
                numerator = numerator * xj % PRIME
                denominator = denominator * (xj - xi) % PRIME
        weights.append(numerator * pow(denominator, -1, PRIME) % PRIME)
    return tuple(weights)


def combine(shares: Mapping[int, int], threshold: int) -> bytes:
    """The 32-byte secret from at least `threshold` shares (the first `threshold` by x)."""
    if len(shares) < threshold:
        raise ValueError(f"{len(shares)} shares, {threshold} needed")
    xs = tuple(sorted(shares)[:threshold])
    value = sum(w * shares[x] for w, x in zip(lagrange_at_zero(xs), xs, strict=True)) % PRIME
    if value >= 1 << 256:
        raise ValueError("the shares do not recover a 32-byte secret")
    return value.to_bytes(32, "big")


def to_bytes(share: int) -> bytes:
    return share.to_bytes(SHARE_BYTES, "big")


def from_bytes(data: bytes) -> int:
    value = int.from_bytes(data, "big")
    if len(data) != SHARE_BYTES or value >= PRIME:
        raise ValueError("not a share")
    return value
