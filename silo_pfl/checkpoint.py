"""Checkpoints: one party's state after a round, written atomically and verified when read.

Each checkpoint is `round-NNNNNN.pt` (torch.save of plain containers and tensors, read back with
`weights_only=True`) and, written last, its manifest `round-NNNNNN.sha256`. A checkpoint without
a manifest is partial; one whose bytes do not match its manifest is corrupted. Either is named in
one line and skipped for the previous good round. Only the newest KEEP checkpoints are kept: the
oldest beyond them is recycled into the next one (its manifest removed first, then its file
renamed and overwritten in place), since freeing a file's blocks can cost a millisecond (a file
system mounted with `discard`) where overwriting them costs nothing more than writing.

A file is on disk before the call that wrote it returns. Alone, each file and its directory are
fsynced. Inside `durable_together` (a worker's call for all its silos) the files are written and
renamed at once and made durable together as the block ends, by one sync of their file system:
a commit of five silos then waits for the disk once, not forty times. A machine that crashes
inside the block leaves at worst a checkpoint that fails its manifest check, skipped for the
previous one, which an earlier block made durable; the driver counts none of the block's rounds
as committed before the block has ended. Only files already durable are recycled; any other
stale checkpoint is deleted once the block is durable.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import io
import logging
import os
import re
import secrets
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from silo_pfl.errors import FederationError

KEEP = 3
_NAME = re.compile(r"^round-(\d{6})\.pt$")
log = logging.getLogger("silo_pfl.checkpoint")
_open = threading.local()  # .block: this thread's durable_together block, if one is open


@dataclass
class _Block:
    """What a durable_together block wrote, and the old checkpoints it deletes once durable."""

    written: set[Path] = field(default_factory=set)
    stale: list[Path] = field(default_factory=list)


class CheckpointError(FederationError):
    """A checkpoint is missing, partial or corrupted: names the file."""


def path_of(directory: Path, round_: int) -> Path:
    """Where the checkpoint of `round_` lives in `directory`."""
    return directory / f"round-{round_:06d}.pt"


def _manifest(path: Path) -> Path:
    return path.with_suffix(".sha256")


def write_atomic(path: Path, data: bytes, reuse: Path | None = None) -> None:
    """Write `data` to a temporary file beside `path`, then rename it; on disk when this returns,
    or when the enclosing `durable_together` block ends. `reuse`, a hidden file no longer needed
    (`_hidden`), is that temporary file, overwritten in place: nothing is freed or allocated."""
    block: _Block | None = getattr(_open, "block", None)
    if reuse is None:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    else:
        fd, tmp = os.open(reuse, os.O_WRONLY), str(reuse)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.truncate()
            if block is None:
                handle.flush()
                os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if block is None:
        _fsync(path.parent)
    else:
        block.written.add(path)


def append_line(path: Path, line: bytes) -> None:
    """Append `line` to `path` (created if absent); on disk when this returns, or when the
    enclosing `durable_together` block ends."""
    block: _Block | None = getattr(_open, "block", None)
    with open(path, "ab") as handle:
        handle.write(line)
        if block is None:
            handle.flush()
            os.fsync(handle.fileno())
    if block is None:
        _fsync(path.parent)
    else:
        block.written.add(path)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _libc_syncfs() -> Any:
    """Linux's syncfs(2), or None where the C library has none."""
    try:
        return getattr(ctypes.CDLL(None, use_errno=True), "syncfs", None)
    except OSError:
        return None


_SYNCFS = _libc_syncfs()


def _syncfs(directory: Path) -> None:
    """Flush the whole file system that holds `directory`."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        if _SYNCFS(fd) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"syncfs {directory}: {os.strerror(error)}")
    finally:
        os.close(fd)


@contextlib.contextmanager
def durable_together() -> Iterator[None]:
    """Checkpoints saved in this block (in this thread) reach the disk together as it ends: one
    sync per file system where the OS has syncfs, else each file and directory fsynced. Stale
    checkpoints that were not recycled are deleted after that."""
    if getattr(_open, "block", None) is not None:
        yield  # already inside a block: its end makes these durable too
        return
    _open.block = block = _Block()
    try:
        yield
    finally:
        _open.block = None
        directories = {path.parent for path in block.written}
        if _SYNCFS is not None:
            by_device = {directory.stat().st_dev: directory for directory in directories}
            for directory in by_device.values():
                _syncfs(directory)
        else:
            for path in block.written:
                _fsync(path)
            for directory in directories:
                _fsync(directory)
        _prune(block.stale)


def _prune(paths: list[Path]) -> None:
    for path in paths:
        path.unlink(missing_ok=True)


def save(directory: Path, round_: int, state: dict[str, Any]) -> Path:
    """Write `state` as the checkpoint of `round_`, its manifest last. The oldest checkpoint
    beyond the newest KEEP is recycled into it (its manifest removed first, so it is never read
    again); any other beyond them is pruned."""
    directory.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    data = buffer.getvalue()
    path = path_of(directory, round_)
    stale = sorted({*rounds(directory, verified=False), round_})[:-KEEP]
    block: _Block | None = getattr(_open, "block", None)
    oldest = path_of(directory, stale[0]) if stale else None
    if oldest is not None and block is not None and oldest in block.written:
        oldest = None  # not on disk for sure yet: only a durable checkpoint is given up early
    # The manifest first: from then on the old round is never read again.
    hidden = [_hidden(_manifest(oldest)), _hidden(oldest)] if oldest is not None else [None, None]
    try:
        write_atomic(path, data, hidden[1])
        digest = hashlib.sha256(data).hexdigest()
        write_atomic(_manifest(path), f"{digest}  {path.name}\n".encode(), hidden[0])
    except BaseException:
        for leftover in hidden:
            if leftover is not None:
                leftover.unlink(missing_ok=True)
        raise
    pruned = [path_of(directory, old) for old in (stale[1:] if oldest is not None else stale)]
    files = [*map(_manifest, pruned), *pruned]
    if block is None:
        _prune(files)
    else:
        block.stale.extend(files)
    return path


def _hidden(path: Path) -> Path | None:
    """`path` renamed to a hidden temporary name beside it (None if it does not exist)."""
    hidden = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    try:
        os.replace(path, hidden)
    except FileNotFoundError:
        return None
    return hidden


def rounds(directory: Path, verified: bool = True) -> list[int]:
    """The rounds with a checkpoint file in `directory` (with a manifest, if `verified`), sorted."""
    if not directory.is_dir():
        return []
    found = []
    for entry in directory.iterdir():
        match = _NAME.match(entry.name)
        if match and (not verified or _manifest(entry).is_file()):
            found.append(int(match.group(1)))
    return sorted(found)


def load(directory: Path, round_: int) -> dict[str, Any]:
    """The checkpoint of `round_`, after checking it against its manifest."""
    path = path_of(directory, round_)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path}: not found")
    manifest = _manifest(path)
    if not manifest.is_file():
        raise CheckpointError(f"checkpoint {path}: partial (no manifest {manifest.name})")
    data = path.read_bytes()
    expected = manifest.read_text().split()[0] if manifest.read_text().split() else ""
    if hashlib.sha256(data).hexdigest() != expected:
        raise CheckpointError(f"checkpoint {path}: corrupted (its SHA-256 differs from manifest)")
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:  # a manifest that matches, but a file torch cannot read
        raise CheckpointError(f"checkpoint {path}: unreadable ({type(exc).__name__})") from None


def load_latest(directory: Path) -> tuple[int, dict[str, Any]] | None:
    """The newest good checkpoint; a newer partial or corrupted one is logged and skipped."""
    for round_ in reversed(rounds(directory, verified=False)):
        try:
            return round_, load(directory, round_)
        except CheckpointError as exc:
            log.warning("%s; using the previous round's", exc)
    return None
