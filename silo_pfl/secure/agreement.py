"""Keys two silos agree on (X25519, then HKDF-SHA256 bound to the federation, round, attempt
and both names), and the sealing of shares between them (ChaCha20-Poly1305)."""

from __future__ import annotations

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
)

KEY_BYTES = 32  # an X25519 public key's raw length
_NONCE = bytes(12)  # every sealing key seals one message, in one direction


def raw_public(key: X25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def raw_private(key: X25519PrivateKey) -> bytes:
    return key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())


def _derive(private: X25519PrivateKey, peer_public: bytes, info: bytes) -> bytes:
    secret = private.exchange(X25519PublicKey.from_public_bytes(peer_public))
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(secret)


def mask_key(
    private: X25519PrivateKey,
    peer_public: bytes,
    federation: str,
    round_: int,
    attempt: int,
    a: str,
    b: str,
) -> bytes:
    """The 256-bit key of the mask silos `a` and `b` share in one round's attempt."""
    first, second = sorted((a, b))
    info = f"silo_pfl secagg mask|{federation}|{round_}|{attempt}|{first}|{second}".encode()
    return _derive(private, peer_public, info)


def _seal_context(federation: str, round_: int, attempt: int, sender: str, holder: str) -> bytes:
    return f"silo_pfl secagg seal|{federation}|{round_}|{attempt}|{sender}|{holder}".encode()


def seal(
    private: X25519PrivateKey,
    holder_public: bytes,
    plaintext: bytes,
    federation: str,
    round_: int,
    attempt: int,
    sender: str,
    holder: str,
) -> bytes:
    """`plaintext` from `sender` to `holder`, readable and authenticated only by the holder."""
    context = _seal_context(federation, round_, attempt, sender, holder)
    key = _derive(private, holder_public, context)
    return ChaCha20Poly1305(key).encrypt(_NONCE, plaintext, context)


def unseal(
    private: X25519PrivateKey,
    sender_public: bytes,
    sealed: bytes,
    federation: str,
    round_: int,
    attempt: int,
    sender: str,
    holder: str,
) -> bytes | None:
    """The plaintext `sender` sealed to `holder`; None if it was altered or misaddressed."""
    context = _seal_context(federation, round_, attempt, sender, holder)
    key = _derive(private, sender_public, context)
    try:
        return ChaCha20Poly1305(key).decrypt(_NONCE, sealed, context)
    except InvalidTag:
        return None
