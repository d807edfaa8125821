"""Checkpoints: one party's state after a round, written atomically and verified when read.

Each checkpoint is `round-NNNNNN.pt` (torch.save of plain containers and tensors, read back with
`weights_only=True`) and, written last, its manifest `round-NNNNNN.sha256`. A checkpoint without
a manifest is partial; one whose bytes do not match its manifest is corrupted. Either is named in
one line and skipped for the previous good round. Only the newest KEEP checkpoints are kept.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch

from silo_pfl.errors import FederationError

KEEP = 3
_NAME = re.compile(r"^round-(\d{6})\.pt$")
log = logging.getLogger("silo_pfl.checkpoint")


class CheckpointError(FederationError):
    """A checkpoint is missing, partial or corrupted: names the file."""


def path_of(directory: Path, round_: int) -> Path:
    """Where the checkpoint of `round_` lives in `directory`."""
    return directory / f"round-{round_:06d}.pt"


def _manifest(path: Path) -> Path:
    return path.with_suffix(".sha256")


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to a temporary file beside `path`, flush it to disk, then rename it."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def save(directory: Path, round_: int, state: dict[str, Any]) -> Path:
    """Write `state` as the checkpoint of `round_`, its manifest last; prune old checkpoints."""
    directory.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    data = buffer.getvalue()
    path = path_of(directory, round_)
    write_atomic(path, data)
    digest = hashlib.sha256(data).hexdigest()
    write_atomic(_manifest(path), f"{digest}  {path.name}\n".encode())
    for old in rounds(directory, verified=False)[:-KEEP]:
        _manifest(path_of(directory, old)).unlink(missing_ok=True)
        path_of(directory, old).unlink(missing_ok=True)
    return path


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
