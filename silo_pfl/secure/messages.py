"""What the secure-aggregation protocol's steps send, each bound to its round and attempt."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Advertisement:
    """Step 1: a silo's two fresh X25519 public keys for one round, signed by its identity."""

    silo: str
    round: int
    attempt: int
    cipher_key: bytes  # seals the shares it sends and receives
    mask_key: bytes  # agrees the pairwise masks
    signature: bytes = b""

    def signed_bytes(self, federation: str) -> bytes:
        head = f"silo_pfl secagg advertise|{federation}|{self.silo}|{self.round}|{self.attempt}|"
        return head.encode() + self.cipher_key + self.mask_key


def roster(adverts: Mapping[str, Advertisement], federation: str) -> bytes:
    """A SHA-256 of an attempt's advertisements, every enrolled silo's fresh keys in silo
    order: what a pairing and a confirmation are signed over. Identity keys outlive runs, and
    every run counts rounds and attempts from 1, so one signed in an earlier run (or over
    other keys than a silo was shown: a coordinator's mix of runs) does not verify."""
    digest = hashlib.sha256(b"silo_pfl secagg roster")
    for silo in sorted(adverts):
        signed = adverts[silo].signed_bytes(federation)
        digest.update(len(signed).to_bytes(4, "big") + signed)
    return digest.digest()


@dataclass(frozen=True)
class SealedShares:
    """Step 2: a silo's shares of its self-mask seed and mask key, sealed to each holder."""

    silo: str
    round: int
    attempt: int
    sealed: dict[str, bytes]  # holder -> AEAD ciphertext


@dataclass(frozen=True)
class Pairing:
    """Step 3's receipt: the peers a silo paired its masks with in one attempt, signed by its
    identity. The unmask request carries every survivor's, so that each silo can check that
    the survivors' masks tie them into one sum before it reveals anything."""

    silo: str
    round: int
    attempt: int
    peers: tuple[str, ...]
    signature: bytes = b""

    def signed_bytes(self, federation: str, attempt_roster: bytes) -> bytes:
        """The pairing, bound to the attempt's advertisements (`roster`)."""
        peers = ",".join(sorted(self.peers))
        head = (
            f"silo_pfl secagg paired|{federation}|{self.silo}|{self.round}|{self.attempt}|{peers}|"
        )
        return head.encode() + attempt_roster


@dataclass(frozen=True)
class UnmaskRequest:
    """Step 4: whose masked vectors arrived (survivors) and who dropped after step 2, with each
    survivor's signed pairing; with the survivors' signatures of it (the consistency round) once
    they have confirmed it."""

    round: int
    attempt: int
    survivors: tuple[str, ...]
    dropped: tuple[str, ...]
    signatures: tuple[tuple[str, bytes], ...] = ()  # (survivor, its signature of the request)
    pairings: tuple[Pairing, ...] = ()  # each survivor's, as it signed it when it masked

    def signed_bytes(self, federation: str) -> bytes:
        """The request as its survivors confirm it: its round, attempt and sets (not the
        pairings, each signed by its own survivor, nor the signatures)."""
        sets = f"{','.join(sorted(self.survivors))}|{','.join(sorted(self.dropped))}"
        return f"silo_pfl secagg unmask|{federation}|{self.round}|{self.attempt}|{sets}".encode()

    def confirmation_bytes(self, federation: str, attempt_roster: bytes) -> bytes:
        """What a survivor signs to confirm this request: the request, bound to the attempt's
        advertisements (`roster`)."""
        return self.signed_bytes(federation) + attempt_roster


@dataclass(frozen=True)
class Reveal:
    """Step 4's answer: the shares a survivor holds, of survivors' self-mask seeds and of the
    dropped silos' mask keys (never both for one silo)."""

    silo: str
    round: int
    attempt: int
    seeds: dict[str, bytes]  # survivor -> share of its self-mask seed
    mask_keys: dict[str, bytes]  # dropped silo -> share of its mask key
