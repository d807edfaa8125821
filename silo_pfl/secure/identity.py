"""Each silo's long-term Ed25519 identity: made once in its key directory, never wiped by a run;
its public half is distributed out of band and listed in the federation's config."""

from __future__ import annotations

import base64
import binascii
import logging
import re
import shlex
import stat
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
# A line of aggregation.identity_keys as `silo-pfl keys show` prints it.
SHOWN_LINE = re.compile(r"silos\.(?P<silo>[^=]+)\.identity_key=(?P<key>\S+)")


def default_key_dir(federation: str, silo: str) -> Path:
    """~/.silo_pfl/keys/<federation>/<silo>."""
    return Path.home() / ".silo_pfl" / "keys" / federation / silo


def key_dir(cfg: Any, silo: str) -> Path:
    """silos.<silo>.key_dir, or the default for this federation."""
    section = cfg.silos.get(silo)
    configured = getattr(section, "key_dir", None) if section is not None else None
    return Path(configured).expanduser() if configured else default_key_dir(cfg.name, silo)


def keys_init_command(cfg: Any, silo: str) -> str:
    """The `silo-pfl keys init` that makes `silo`'s key where its config looks for it."""
    directory = key_dir(cfg, silo)
    words = ["silo-pfl", "keys", "init", "--federation", cfg.name, "--silo", silo]
    if directory != default_key_dir(cfg.name, silo):
        words += ["--key-dir", str(directory)]
    return shlex.join(words)


def create(directory: Path, show_command: str = "silo-pfl keys show") -> Ed25519PrivateKey:
    """A new identity in `directory`; refuses to replace one (`show_command` prints it)."""
    path = directory / PRIVATE_FILE
    if path.is_dir():
        raise SiloPflError(_is_a_directory(path))
    _warn_if_open(directory)
    try:
        key = _create_new(directory)
    except OSError as exc:
        raise SiloPflError(
            f"{directory}: cannot write an identity key there ({exc.strerror or exc})"
        ) from None
    if key is None:
        raise SiloPflError(
            f"{path}: an identity key exists already and is never replaced; "
            f"{show_command} prints its public key"
        )
    return key


def _create_new(directory: Path) -> Ed25519PrivateKey | None:
    """A new key, written whole; None if another process made this directory's key first."""
    key = Ed25519PrivateKey.generate()
    raw = key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
    return key if create_once(directory / PRIVATE_FILE, raw) else None


def load(
    directory: Path, init_command: str = "silo-pfl keys init", owner: str = ""
) -> Ed25519PrivateKey:
    """The identity in `directory` (`init_command` makes it, where there is none; `owner`, the
    silo it is for, is then named first)."""
    path = directory / PRIVATE_FILE
    _warn_if_open(directory)
    if owner:
        missing = (
            f"silo {owner}: no identity key in its key directory {directory}, and the config "
            f"lists the silos' keys; create it with {init_command}, then list the key it prints"
        )
    else:
        missing = f"{path}: no identity key; create it with {init_command}"
    return _read(path, missing)


def load_or_create(directory: Path) -> Ed25519PrivateKey:
    """The identity in `directory`, made on first use."""
    path = directory / PRIVATE_FILE
    _warn_if_open(directory)
    if not path.exists() and (key := _create_new(directory)) is not None:
        return key
    return _read(path, f"{path}: no identity key; create it with silo-pfl keys init")


def own_identity(cfg: Any, silo: str, trusted: Mapping[str, bytes] | None) -> Ed25519PrivateKey:
    """`silo`'s identity, from its key directory. Where the config lists the silos' keys
    (`trusted`) it is only loaded, and a missing one is named with the command that makes it;
    with none listed it is made on first use (the driver relays the public halves)."""
    directory = key_dir(cfg, silo)
    if not trusted:
        return load_or_create(directory)
    return load(directory, keys_init_command(cfg, silo), owner=silo)


def _read(path: Path, missing: str) -> Ed25519PrivateKey:
    """The key in `path` (`missing`: the message if there is none); refuses a file that others
    than its owner may read or write."""
    try:
        mode = path.stat().st_mode
        if stat.S_ISDIR(mode):
            raise SiloPflError(_is_a_directory(path))
        if stat.S_IMODE(mode) & 0o066:
            raise SiloPflError(
                f"{path}: mode {stat.S_IMODE(mode):04o} lets others than its owner read or write "
                f"the identity key; allow its owner only: chmod 600 {shlex.quote(str(path))}"
            )
        raw = path.read_bytes()
    except FileNotFoundError:
        raise SiloPflError(missing) from None
    except OSError as exc:
        raise SiloPflError(f"{path}: cannot read the identity key ({exc.strerror})") from None
    try:
        return Ed25519PrivateKey.from_private_bytes(raw)
    except ValueError:
        raise SiloPflError(f"{path}: not a raw 32-byte Ed25519 private key") from None


def _is_a_directory(path: Path) -> str:
    return f"{path}: is a directory, expected the identity key's file (32 raw bytes)"


def _warn_if_open(directory: Path) -> None:
    """A warning if others than its owner may write in `directory` (and replace the key)."""
    try:
        mode = stat.S_IMODE(directory.stat().st_mode)
    except OSError:
        return
    if mode & 0o022:
        log.warning(
            "%s: key directory of mode %04o, in which others than its owner may replace the "
            "identity key; allow its owner only: chmod 700 %s",
            directory,
            mode,
            shlex.quote(str(directory)),
        )


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
    """aggregation.identity_keys: lines of `<silo> <base64 key>`, or of
    `silos.<silo>.identity_key=<base64 key>` as silo-pfl keys show prints them; '#' starts a
    comment. A pipe or a device is refused before it is opened (a pipe no one writes to would
    wait for ever, and a process substitution is the driver's alone: no silo could read it)."""
    where = path.expanduser()
    try:
        if where.exists() and not where.is_file():
            raise ConfigError(
                f"aggregation.identity_keys: {path} is not a regular file; name a file that "
                "lists the silos' keys"
            )
        text = where.read_text(encoding="utf-8")
    except OSError as exc:
        message = f"aggregation.identity_keys: cannot read {path} ({exc.strerror})"
        raise ConfigError(message) from None
    except UnicodeDecodeError:
        raise ConfigError(f"aggregation.identity_keys: {path} is not a UTF-8 text file") from None
    keys: dict[str, str] = {}
    lines: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        shown = SHOWN_LINE.fullmatch(words[0]) if len(words) == 1 else None
        if shown is None and len(words) != 2:
            raise ConfigError(
                f"aggregation.identity_keys: {path} line {number}: expected one '<silo> <base64 "
                "key>' or 'silos.<silo>.identity_key=<base64 key>' per silo"
            )
        silo, key = (shown["silo"], shown["key"]) if shown else (words[0], words[1])
        if silo in keys:
            raise ConfigError(
                f"aggregation.identity_keys: {path} line {number}: silo {silo} again (first on "
                f"line {lines[silo]}); list each silo once"
            )
        keys[silo], lines[silo] = key, number
    if not keys:  # named, yet trusting no key would fall back to the keys the silos report
        raise ConfigError(
            f"aggregation.identity_keys: {path} lists no silo; list every silo's key "
            "(silo-pfl keys show), or drop aggregation.identity_keys"
        )
    return keys


def configured_keys(cfg: Any, silos: list[str]) -> dict[str, bytes] | None:
    """Every silo's public identity from silos.<name>.identity_key or aggregation.identity_keys;
    None when neither lists any (the driver then relays the keys the silos report). The data
    source's late silos (data.late_silos) may be listed too; no two silos may share a key."""
    data = cfg.data  # a dict where the config was merged without the data sources (the server)
    late = data.get("late_silos") if isinstance(data, Mapping) else data.late_silos
    known = [*silos, *(s for s in late or () if s not in silos)]
    path = Path(cfg.aggregation.identity_keys) if cfg.aggregation.identity_keys else None
    entries: list[tuple[str, str, str, str]] = []  # silo, its key, where listed, what names it
    for silo, text in (read_key_file(path) if path else {}).items():
        if silo not in known:
            raise ConfigError(
                f"aggregation.identity_keys: {path} lists {silo}, not a silo of this "
                f"federation ({', '.join(known)})"
            )
        where = f"aggregation.identity_keys ({path})"
        entries.append((silo, text, where, f"{where}, silo {silo}"))
    for silo in known:
        section = cfg.silos.get(silo)
        text = getattr(section, "identity_key", None) if section is not None else None
        if text:
            entries.append((silo, text, f"silos.{silo}.identity_key", f"silos.{silo}.identity_key"))
    if not entries:
        return None
    missing = [s for s in silos if s not in {entry[0] for entry in entries}]
    if missing and path:
        raise ConfigError(
            f"aggregation.identity_keys: {path} has no key for silo {missing[0]}, nor has "
            f"silos.{missing[0]}.identity_key; list every silo's public identity key (silo-pfl "
            "keys show), or none"
        )
    if missing:
        raise ConfigError(
            f"silos.{missing[0]}.identity_key: missing; list every silo's public identity key "
            "(silo-pfl keys show), or none"
        )
    listed: dict[str, bytes] = {}
    owners: dict[bytes, tuple[str, str]] = {}  # a key's first silo, and where it is listed
    for silo, text, where, line in entries:
        key = decode_public(text, line)
        if listed.get(silo, key) != key:
            raise ConfigError(
                f"{where}: not the key {owners[listed[silo]][1]} lists for {silo}; list one "
                "key per silo, in one place or the same in both"
            )
        first, first_where = owners.setdefault(key, (silo, where))
        if first != silo:
            places = dict.fromkeys((first_where, where))
            raise ConfigError(
                f"{' and '.join(places)}: silos {first} and {silo} have the same public identity "
                "key; each silo needs a key of its own (silo-pfl keys init on its node)"
            )
        listed[silo] = key
    return {silo: listed[silo] for silo in silos}


def check_own(silo: str, own: bytes, trusted: Mapping[str, bytes] | None) -> None:
    """A silo refuses to run under an identity the federation does not list for it."""
    if trusted is not None and trusted.get(silo) != own:
        raise SiloPflError(
            f"silo {silo}: its identity key is not the one the config lists for it "
            f"(silos.{silo}.identity_key or aggregation.identity_keys)"
        )


def relayed(cfg: Any, reported: Mapping[str, bytes]) -> dict[str, bytes]:
    """The identities the silos reported, for the driver to relay when the config lists none
    (then a lying driver could substitute them: said once, as a warning). Two silos may not
    report one identity (their key directories are one)."""
    if not cfg.aggregation.secure:
        return {}
    configured = configured_keys(cfg, sorted(reported))
    owners: dict[bytes, str] = {}
    for silo in sorted(reported):
        first = owners.setdefault(reported[silo], silo)
        if first != silo:
            raise ConfigError(
                f"silos {first} and {silo} report the same identity key, from key directories "
                f"{key_dir(cfg, first)} and {key_dir(cfg, silo)} (silos.<name>.key_dir); each "
                "silo needs a key directory of its own"
            )
    if configured is None:
        log.warning(
            "aggregation.secure: no identity keys are configured, so the silos trust the keys "
            "the driver relays; this protects against a curious server, not a lying driver. "
            "List them in aggregation.identity_keys (silo-pfl keys show)"
        )
    return dict(reported)
