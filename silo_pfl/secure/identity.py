"""Each silo's long-term Ed25519 identity: made once in its key directory, never wiped by a run;
its public half is distributed out of band and listed in the federation's config."""

from __future__ import annotations

import base64
import binascii
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
)

from silo_pfl.create_once import create_once
from silo_pfl.errors import ConfigError, SiloPflError

log = logging.getLogger("silo_pfl.secure")
PRIVATE_FILE = "identity.key"  # 32 raw bytes, mode 0600, in a directory of mode 0700


def default_key_dir(federation: str, silo: str) -> Path:
    """~/.silo_pfl/keys/<federation>/<silo>."""
    return Path.home() / ".silo_pfl" / "keys" / federation / silo


def key_dir(cfg: Any, silo: str) -> Path:
    """silos.<silo>.key_dir, or the default for this federation."""
    section = cfg.silos.get(silo)
    configured = getattr(section, "key_dir", None) if section is not None else None
    return Path(configured).expanduser() if configured else default_key_dir(cfg.name, silo)


def create(directory: Path, show_command: str = "silo-pfl keys show") -> Ed25519PrivateKey:
    """A new identity in `directory`; refuses to replace one (`show_command` prints it)."""
    key = _create_new(directory)
    if key is None:
        raise SiloPflError(
            f"{directory / PRIVATE_FILE}: an identity key exists already and is never replaced; "
            f"{show_command} prints its public key"
        )
    return key


def _create_new(directory: Path) -> Ed25519PrivateKey | None:
    """A new key, written whole; None if another process made this directory's key first."""
    key = Ed25519PrivateKey.generate()
    raw = key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
    return key if create_once(directory / PRIVATE_FILE, raw) else None


def load(directory: Path, init_command: str = "silo-pfl keys init") -> Ed25519PrivateKey:
    """The identity in `directory` (`init_command` makes it, where there is none)."""
    path = directory / PRIVATE_FILE
    try:
        raw = path.read_bytes()
        return Ed25519PrivateKey.from_private_bytes(raw)
    except FileNotFoundError:
        raise SiloPflError(f"{path}: no identity key; create it with {init_command}") from None
    except ValueError:
        raise SiloPflError(f"{path}: not a raw 32-byte Ed25519 private key") from None


def load_or_create(directory: Path) -> Ed25519PrivateKey:
    """The identity in `directory`, made on first use."""
    if not (directory / PRIVATE_FILE).exists() and (key := _create_new(directory)) is not None:
        return key
    return load(directory)


def public_bytes(key: Ed25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def encode_public(raw: bytes) -> str:
    """The public half as operators exchange it: base64 of its 32 raw bytes."""
    return base64.b64encode(raw).decode("ascii")


def decode_public(text: str, where: str) -> bytes:
    """32 raw bytes from base64; a one-line ConfigError naming `where` otherwise."""
    try:
        raw = base64.b64decode(str(text).strip(), validate=True)
        Ed25519PublicKey.from_public_bytes(raw)
    except (binascii.Error, ValueError):
        raise ConfigError(
            f"{where}: not an Ed25519 public key (base64 of 32 bytes, as silo-pfl keys show "
            "prints it)"
        ) from None
    return raw


def read_key_file(path: Path) -> dict[str, str]:
    """aggregation.identity_keys: lines of `<silo> <base64 key>`; '#' starts a comment."""
    try:
        text = path.expanduser().read_text()
    except OSError as exc:
        message = f"aggregation.identity_keys: cannot read {path} ({exc.strerror})"
        raise ConfigError(message) from None
    keys: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        if len(words) != 2 or words[0] in keys:
            raise ConfigError(
                f"aggregation.identity_keys: {path} line {number}: expected one "
                "'<silo> <base64 key>' per silo"
            )
        keys[words[0]] = words[1]
    return keys


def configured_keys(cfg: Any, silos: list[str]) -> dict[str, bytes] | None:
    """Every silo's public identity from silos.<name>.identity_key or aggregation.identity_keys;
    None when neither lists any (the driver then relays the keys the silos report)."""
    listed: dict[str, tuple[str, str]] = {}
    if cfg.aggregation.identity_keys:
        path = Path(cfg.aggregation.identity_keys)
        for silo, text in read_key_file(path).items():
            if silo not in silos:
                raise ConfigError(
                    f"aggregation.identity_keys: {path} lists {silo}, not a silo of this "
                    f"federation ({', '.join(silos)})"
                )
            listed[silo] = (text, f"aggregation.identity_keys ({path}), silo {silo}")
    for silo in silos:
        section = cfg.silos.get(silo)
        text = getattr(section, "identity_key", None) if section is not None else None
        if text:
            listed[silo] = (text, f"silos.{silo}.identity_key")
    if not listed:
        return None
    missing = [s for s in silos if s not in listed]
    if missing:
        raise ConfigError(
            f"silos.{missing[0]}.identity_key: missing; list every silo's public identity key "
            "(silo-pfl keys show), or none"
        )
    return {silo: decode_public(text, where) for silo, (text, where) in listed.items()}


def check_own(silo: str, own: bytes, trusted: Mapping[str, bytes] | None) -> None:
    """A silo refuses to run under an identity the federation does not list for it."""
    if trusted is not None and trusted.get(silo) != own:
        raise SiloPflError(
            f"silo {silo}: its identity key is not the one the config lists for it "
            f"(silos.{silo}.identity_key or aggregation.identity_keys)"
        )


def relayed(cfg: Any, reported: Mapping[str, bytes]) -> dict[str, bytes]:
    """The identities the silos reported, for the driver to relay when the config lists none
    (then a lying driver could substitute them: said once, as a warning)."""
    if not cfg.aggregation.secure:
        return {}
    if configured_keys(cfg, sorted(reported)) is None:
        log.warning(
            "aggregation.secure: no identity keys are configured, so the silos trust the keys "
            "the driver relays; this protects against a curious server, not a lying driver. "
            "List them in aggregation.identity_keys (silo-pfl keys show)"
        )
    return dict(reported)
