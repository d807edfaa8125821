"""Files on disk before the call that wrote them returns: written atomically (a temporary file
beside the target, then a rename), or, inside `durable_together`, made durable together as the
block ends.

Alone, each file and its directory are fsynced. Inside `durable_together` (a worker's call for
all its silos) the files are written and renamed at once and made durable together as the
block ends, by one sync of their file system: a commit of five silos then waits for the disk
once, not twenty times. A file of a megabyte or more starts on its way to the disk as soon as
it is written (sync_file_range), while the block writes the next ones, so that the sync waits
for less. A machine that crashes inside the block leaves at worst a file that fails its
reader's check (a checkpoint's digest), which an earlier block made durable a round before; the
driver counts none of the block's rounds as committed before the block has ended. Files that a
writer gives up inside a block (`delete_when_durable`) are deleted once the block is durable.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import stat
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_open = threading.local()  # .block: this thread's durable_together block, if one is open
Buffer = bytes | bytearray | memoryview
Writer = Callable[[int], int]  # writes a file's content into its descriptor; returns its size


@dataclass
class _Block:
    """What a durable_together block wrote, and the files it deletes once durable."""

    written: set[Path] = field(default_factory=set)
    stale: list[Path] = field(default_factory=list)


def _open_block() -> _Block | None:
    """This thread's open durable_together block, if any."""
    return getattr(_open, "block", None)


def write_atomic(path: Path, data: bytes | Writer, reuse: Path | None = None) -> None:
    """Write `data` to a temporary file beside `path`, then rename it; on disk when this returns,
    or when the enclosing `durable_together` block ends. `data` is the bytes, or a Writer that
    writes them into the open file. `reuse`, a hidden file no longer needed (a recycled
    checkpoint), is that temporary file, overwritten in place: nothing is freed or allocated.
    A file replaced keeps its permission bits; a new one is the owner's alone (0600)."""
    block = _open_block()
    if reuse is None:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    else:
        fd, tmp = os.open(reuse, os.O_WRONLY), str(reuse)
    try:
        try:
            with contextlib.suppress(FileNotFoundError):
                os.fchmod(fd, stat.S_IMODE(os.stat(path).st_mode))
            size = data(fd) if callable(data) else write_all(fd, data)
            os.ftruncate(fd, size)
            if block is None:
                os.fsync(fd)
            else:
                _start_writeback(fd, size)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _entry_durable(path)


def _entry_durable(path: Path) -> None:
    """A file just renamed into place: its directory entry synced now, or with the enclosing
    `durable_together` block."""
    block = _open_block()
    if block is None:
        _fsync(path.parent)
    else:
        block.written.add(path)


def link_atomic(path: Path, source: Path, header: bytes) -> None:
    """Hard-link `source` at `path` (through a temporary name beside it, then a rename), if the
    file linked begins with `header` (else FileExistsError); durable as `write_atomic`'s file
    is."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    os.link(source, tmp)
    try:
        with open(tmp, "rb", buffering=0) as handle:
            if handle.read(len(header)) != header:
                raise FileExistsError(f"{source} is no longer the file this thread saved")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # where `path` was already that file, the rename did nothing
    _entry_durable(path)


def write_all(fd: int, data: Buffer) -> int:
    """Write all of `data` at the file's offset; return its size in bytes."""
    view = memoryview(data).cast("B")
    size = len(view)
    while view:
        view = view[os.write(fd, view) :]
    return size


def append_line(path: Path, line: bytes) -> None:
    """Append `line` to `path` (created if absent); on disk when this returns, or when the
    enclosing `durable_together` block ends."""
    block = _open_block()
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


def _libc(name: str) -> Any:
    """The C library's function `name` (Linux's syncfs(2), sync_file_range(2)), or None."""
    try:
        return getattr(ctypes.CDLL(None, use_errno=True), name, None)
    except OSError:
        return None


_SYNCFS = _libc("syncfs")
_SYNC_FILE_RANGE = _libc("sync_file_range")
if _SYNC_FILE_RANGE is not None:
    _SYNC_FILE_RANGE.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
_WRITE = 2  # SYNC_FILE_RANGE_WRITE: start writing the dirty pages back, do not wait
WRITEBACK_BYTES = 1 << 20  # a file this large starts its way to the disk as it is written


def _start_writeback(fd: int, size: int) -> None:
    """Inside a `durable_together` block: start taking a large file to the disk now, while the
    block writes the next ones, so that the sync at the block's end waits for less. Only a hint:
    the block's sync is what makes the file durable."""
    if _SYNC_FILE_RANGE is not None and size >= WRITEBACK_BYTES:
        _SYNC_FILE_RANGE(fd, 0, 0, _WRITE)


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
    """Files written in this block (in this thread) reach the disk together as it ends: one
    sync per file system where the OS has syncfs, else each file and directory fsynced. The
    files given up in it (`delete_when_durable`) are deleted after that."""
    if _open_block() is not None:
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
        _delete(block.stale)


def in_open_block(path: Path) -> bool:
    """Whether `path` was written in this thread's open block, so not surely on disk yet."""
    block = _open_block()
    return block is not None and path in block.written


def delete_when_durable(paths: list[Path]) -> None:
    """Delete `paths` now, or, inside a block, once what it wrote is durable."""
    block = _open_block()
    if block is None:
        _delete(paths)
    else:
        block.stale.extend(paths)


def _delete(paths: list[Path]) -> None:
    for path in paths:
        path.unlink(missing_ok=True)
