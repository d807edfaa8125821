"""Checkpoints: one party's state after a round, written atomically and verified when read.

A checkpoint is one file, `round-NNNNNN.ckpt`, in the format of `checkpoint_format`: a header
line holding a digest of the payload, then the payload, numpy's arrays out of band
(`save_arrays`; torch's kind is still read, as silos of earlier versions wrote it). The
server's (its process never imports torch, nor does this module until a model is saved or a
torch checkpoint read) and a silo's, which holds its tensors as arrays and, with its state, the
round's personalized model, in case it is selected.

A file whose header is missing or cut short is partial; one whose bytes do not match its header is
corrupted. Either is named in one line and skipped for the previous good round. A silo's selected
model is `round-NNNNNN.pt` (`save_model`), torch.save's bytes alone, as MLflow ships and serves
them: its SHA-256 goes into the silo's next checkpoint, which `load` checks it against. Whoever
keeps something taken from a checkpoint hashes that (`save_model`).

`save_shared` writes a part of a checkpoint that several parties of one process may hold byte
for byte (the global keys of a round's model, in every silo a worker holds that evaluated the
federation's global state): the first to save it writes it, the others hard-link that file into
their own directory once its digest shows the bytes are the same, so that a worker writes a
large model's global keys once a round, not once a silo. The checkpoint that names the part
holds its digest, and `load_shared` refuses a file whose header holds another.

Only the newest KEEP files of a directory are kept (and a silo's selected round's checkpoint,
which holds the selected model; and, until the next file is written there, the round the
previous file kept, which a resume from it needs if this write is cut short: every file, where
this process did not write the previous one): the oldest beyond them is recycled into the next
one (renamed to a hidden name, so it is never read again, then overwritten in place), since
freeing a file's blocks can cost a millisecond (a file system mounted with `discard`) where
overwriting them costs nothing more than writing. A `save_shared` file is never recycled, since
its other links would change with it: it is unlinked.

A file is on disk before the call that wrote it returns, or when the enclosing
`durable.durable_together` block ends (`durable`). Only files already durable are recycled; any
other stale file is deleted once the block is durable.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import secrets
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from silo_pfl.checkpoint_format import (
    ARRAYS_MAGIC,
    HEADER,
    KINDS,
    MAGIC,
    Headed,
    arrays_save,
    digest_of,
    torch_load,
    torch_save,
)
from silo_pfl.durable import (
    Writer,
    delete_when_durable,
    in_open_block,
    link_atomic,
    write_atomic,
)
from silo_pfl.errors import FederationError

KEEP = 3
CHECKPOINT, MODEL = ".ckpt", ".pt"  # a verified checkpoint; a selected model's plain file
_NAME = re.compile(r"^round-(\d{6})(\.ckpt|\.pt)$")
log = logging.getLogger("silo_pfl.checkpoint")
_recent = threading.local()  # .shared: this thread's last save_shared: (round, digest, path)
_last: dict[str, tuple[int, int | None]] = {}  # directory -> the round this process last wrote
# there, and the round kept for it (its `spare`)


class CheckpointError(FederationError):
    """A checkpoint is missing, partial or corrupted: names the file."""


def path_of(directory: Path, round_: int, suffix: str = CHECKPOINT) -> Path:
    """Where the checkpoint (or, with suffix=MODEL, the model) of `round_` lives in `directory`."""
    return directory / f"round-{round_:06d}{suffix}"


def save_arrays(directory: Path, round_: int, state: Any, spare: int | None = None) -> Path:
    """Write `state` (plain containers, numpy arrays and numpy scalars) as the checkpoint of
    `round_`, without torch: its header, then its arrays payload (`checkpoint_format`).
    `load` gives it back, its arrays writable; anything it could not, `state` holding any other
    object, raises TypeError here and writes nothing. The file of round `spare`, if given, is
    kept beyond the newest KEEP."""
    writer = Headed(ARRAYS_MAGIC, arrays_save, state)
    return _write_round(directory, round_, CHECKPOINT, writer, spare)


def save_shared(directory: Path, round_: int, state: Any, spare: int | None = None) -> str:
    """`save_arrays` for a part of a checkpoint that other parties of this process may hold
    byte for byte (the global keys of a round's model, the same in every silo a worker holds
    that evaluates the federation's global state): where this thread has just saved the same
    bytes for the same round, in a directory of the same file system, that file is hard-linked
    here, not written again. Returns the payload's digest, for the checkpoint that names this
    file to hold and `load` to check it against. Such a file is never recycled in place (its
    other links would change with it): the files beyond the newest KEEP are unlinked."""
    recent = getattr(_recent, "shared", None)
    if recent is not None and recent[0] == round_:
        digest = arrays_save(state, None).hexdigest()
        if digest == recent[1]:
            header = ARRAYS_MAGIC + digest.encode() + b"\n"
            try:
                _write_round(
                    directory, round_, CHECKPOINT, (recent[2], header), spare, recycle=False
                )
                return digest
            except OSError:  # another file system, no hard links there, the file gone or changed
                log.debug("could not link %s into %s: writing it", recent[2], directory)
    writer = Headed(ARRAYS_MAGIC, arrays_save, state)
    path = _write_round(directory, round_, CHECKPOINT, writer, spare, recycle=False)
    _recent.shared = (round_, writer.digest, path)
    return writer.digest


def save_model(directory: Path, round_: int, state: dict[str, Any]) -> str:
    """Write a model's `state` as torch.save's bytes alone, for round `round_`; return their
    SHA-256, for the caller's next checkpoint to hold (`load` checks the file against it)."""
    digest = ""

    def write(fd: int) -> int:
        nonlocal digest
        written = torch_save(state, fd)
        digest = written.hexdigest()
        return written.size

    _write_round(directory, round_, MODEL, write)
    return digest


def _write_round(
    directory: Path,
    round_: int,
    suffix: str,
    data: Writer | tuple[Path, bytes],
    spare: int | None = None,
    recycle: bool = True,
) -> Path:
    """Write the file of `round_` (`data`, a file and its header: hard-link that file there if
    it still begins with that header). With `recycle`, the oldest beyond the newest KEEP is
    recycled into it (hidden first, so that it is never read again); any other beyond them is
    pruned; never round `spare`'s, nor one the previous file may still need (`_still_needed`)."""
    files = _files(directory, create=True)
    path = path_of(directory, round_, suffix)
    older = sorted({*files, round_})[:-KEEP]
    kept = {spare, *_still_needed(directory, files, round_)}
    stale = [files[old] for old in older if old in files and old not in kept]
    oldest = stale[0] if stale and recycle and callable(data) else None
    if oldest is not None and in_open_block(oldest):
        oldest = None  # not on disk for sure yet: only a durable file is given up early
    hidden = _hidden(oldest) if oldest is not None else None
    try:
        if callable(data):
            write_atomic(path, data, hidden)
        else:
            link_atomic(path, *data)
    except BaseException:
        if hidden is not None:
            hidden.unlink(missing_ok=True)
        raise
    delete_when_durable(stale[1:] if oldest is not None else stale)
    _last[os.path.abspath(directory)] = (round_, spare)
    return path


def _still_needed(directory: Path, files: dict[int, Path], round_: int) -> set[int]:
    """The rounds of `files` that the newest file before `round_` may still need, for a resume
    from it should the write of `round_` be cut short: the round kept for it, where this process
    wrote it; else, not knowing which, every one (they go with the next write)."""
    previous = max((old for old in files if old < round_), default=None)
    if previous is None:
        return set()
    last = _last.get(os.path.abspath(directory))
    if last is not None and last[0] == previous:
        return set() if last[1] is None else {last[1]}
    return set(files)


def _existing(directory: Path, round_: int) -> Path | None:
    """The file of `round_` in `directory`, of either kind, if there is one."""
    for suffix in (CHECKPOINT, MODEL):
        path = path_of(directory, round_, suffix)
        if path.exists():
            return path
    return None


def _hidden(path: Path) -> Path | None:
    """`path` renamed to a hidden temporary name beside it (None if it does not exist)."""
    hidden = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    try:
        os.replace(path, hidden)
    except FileNotFoundError:
        return None
    return hidden


def rounds(directory: Path) -> list[int]:
    """The rounds with a file in `directory`, sorted (`load` checks each when it reads it)."""
    return sorted(_files(directory))


def _files(directory: Path, create: bool = False) -> dict[int, Path]:
    """Each round's file in `directory` (made first if `create` and it is missing)."""
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        if create:
            directory.mkdir(parents=True, exist_ok=True)
        return {}
    return {int(m.group(1)): directory / n for n in names if (m := _NAME.match(n))}


def load(directory: Path, round_: int, sha256: str | None = None) -> Any:
    """The checkpoint of `round_`, after checking it against its header: the arrays kind
    (`save_arrays`) with numpy arrays, torch's kind (as older silos wrote theirs) with its
    tensors; given `sha256`, its header must hold that digest (`save_shared`'s). Or the model
    of `round_` (`save_model`), checked against `sha256` when given."""
    path = _existing(directory, round_)
    if path is None:
        expected = path_of(directory, round_, CHECKPOINT if sha256 is None else MODEL)
        raise CheckpointError(f"checkpoint {expected}: not found")
    decode: Callable[[Any], Any] = torch_load
    checksum, name = hashlib.sha256, "SHA-256"
    with open(path, "rb", buffering=0) as handle:
        if path.suffix == CHECKPOINT:
            header = handle.read(HEADER)
            magic = header[: len(MAGIC)]
            if len(header) < HEADER or magic not in KINDS or header[-1:] != b"\n":
                raise CheckpointError(f"checkpoint {path}: partial (no complete header)")
            named = header[len(MAGIC) : -1].decode("ascii", "replace")
            if sha256 is not None and named != sha256:
                raise CheckpointError(
                    f"checkpoint {path}: not the one expected (its digest differs from the "
                    "checkpoint that names it)"
                )
            sha256, source = named, "its header"
            read, decode, checksum, name = KINDS[magic]
            data = read(handle)
        else:
            data, source = handle.readall(), "the checkpoint that selected it"
    if sha256 is not None and digest_of(checksum, data) != sha256:
        raise CheckpointError(f"checkpoint {path}: corrupted (its {name} differs from {source})")
    try:
        saved = decode(data)
    except Exception as exc:  # a digest that matches, but bytes that cannot be read back
        raise CheckpointError(f"checkpoint {path}: unreadable ({type(exc).__name__})") from None
    held = saved.get("round", round_) if isinstance(saved, dict) else round_
    if held != round_:  # a recycled file whose new bytes a power cut lost: whole, and older
        raise CheckpointError(f"checkpoint {path}: holds round {held}, not round {round_}")
    return saved


def load_shared(directory: Path, round_: int, digest: str) -> Any:
    """The part of a checkpoint `save_shared` wrote for `round_`, whose digest was `digest`."""
    path = path_of(directory, round_)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path}: not found")
    return load(directory, round_, digest)


def load_latest(
    directory: Path, skipped: list[str] | None = None, before: int | None = None
) -> tuple[int, Any] | None:
    """The newest good checkpoint (of a round before `before`, if given); a newer partial or
    corrupted one is logged, its line added to `skipped` if given, and skipped."""
    for round_ in reversed(rounds(directory)):
        if before is not None and round_ >= before:
            continue
        try:
            return round_, load(directory, round_)
        except CheckpointError as exc:
            log.warning("%s; using the previous round's", exc)
            if skipped is not None:
                skipped.append(str(exc))
    return None
