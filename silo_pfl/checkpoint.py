"""Checkpoints: one party's state after a round, written atomically and verified when read.

A checkpoint is one file, `round-NNNNNN.ckpt`: a header line holding a digest of the rest (the
payload), then the payload, of one of two kinds, which the header's magic (its text before the
digest) tells apart, so that `load` needs no argument to read any:

- `save_arrays`: plain containers, numpy arrays and numpy scalars: every checkpoint written
  now. The server's (its process never imports torch, nor does this module until a model is
  saved or a torch checkpoint read) and a silo's, which holds its tensors as arrays and, with
  its state, the round's personalized model, in case it is selected. Header `silo_pfl arrays
  ghash=<hex>` (padded to the torch header's length). The payload is pickle protocol 5 with each
  array's bytes out of band: the stream's length (8 bytes, little-endian), the stream, then each
  buffer as its length (8 bytes) and its bytes, zero-padded before them so that they start at a
  multiple of 64 bytes into the payload. The arrays go from their own memory to the file (only
  a read-only or non-contiguous one is copied first), and come back writable and 64-byte
  aligned, views of one buffer the size of the file. They are read back by an unpickler that
  builds nothing but numpy arrays, dtypes and scalars (`_ALLOWED`), and `save_arrays` refuses,
  before it writes, anything that would need more. The digest is a GHASH: AES-GCM's tag over
  the payload as associated data, under a key and nonce of zeros, a 128-bit polynomial checksum
  that OpenSSL computes with carry-less multiplication, several times faster than a SHA-256 or
  zlib's CRC-32 (docs/BENCHMARKS.md): a large model's file costs its checksum a fraction of its
  writing. It catches a flipped, lost or moved byte, not a forgery; no digest without a secret
  key would, and nothing but its party writes a checkpoint directory. Whoever keeps something
  taken from such a file hashes that (`save_model`). Arrays files written before under a
  SHA-256 (`silo_pfl arrays     sha256=`) or a CRC-32 (`silo_pfl arrays      crc32=`) are still
  read and checked, so that a run resumes across the change.
- Read only: torch.save's bytes of plain containers and tensors, read back with
  `weights_only=True`, as silos of earlier versions wrote their checkpoints. Header `silo_pfl
  checkpoint sha256=<hex>`: their SHA-256.

A file whose header is missing or cut short is partial; one whose bytes do not match its header is
corrupted. Either is named in one line and skipped for the previous good round. A silo's selected
model is `round-NNNNNN.pt` (`save_model`), torch.save's bytes alone, as MLflow ships and serves
them: its SHA-256 goes into the silo's next checkpoint, which `load` checks it against.

`save_shared` writes a part of a checkpoint that several parties of one process may hold byte
for byte (the global keys of a round's model, in every silo a worker holds that evaluated the
federation's global state): the first to save it writes it, the others hard-link that file into
their own directory once its digest shows the bytes are the same, so that a worker writes a
large model's global keys once a round, not once a silo. The checkpoint that names the part
holds its digest, and `load_shared` refuses a file whose header holds another.

Only the newest KEEP files of a directory are kept (and a silo's selected round's checkpoint,
which holds the selected model): the oldest beyond them is recycled into the next one (renamed
to a hidden name, so it is never read again, then overwritten in place), since freeing a file's
blocks can cost a millisecond (a file system mounted with `discard`) where overwriting them
costs nothing more than writing. A `save_shared` file is never recycled, since its other links
would change with it: it is unlinked.

A file is on disk before the call that wrote it returns. Alone, each file and its directory are
fsynced. Inside `durable_together` (a worker's call for all its silos) the files are written and
renamed at once and made durable together as the block ends, by one sync of their file system:
a commit of five silos then waits for the disk once, not twenty times. A file of a megabyte
or more starts on its way to the disk as soon as it is written (sync_file_range), while the
block writes the next ones, so that the sync waits for less. A machine that crashes
inside the block leaves at worst a checkpoint that fails its check, skipped for the previous
one, which an earlier block made durable; the driver counts none of the block's rounds as
committed before the block has ended. Only files already durable are recycled; any other stale
file is deleted once the block is durable.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import importlib
import io
import logging
import os
import pickle
import re
import secrets
import tempfile
import threading
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from silo_pfl.errors import FederationError

KEEP = 3
CHECKPOINT, MODEL = ".ckpt", ".pt"  # a verified checkpoint; a selected model's plain file
_NAME = re.compile(r"^round-(\d{6})(\.ckpt|\.pt)$")
_MAGIC = b"silo_pfl checkpoint sha256="  # torch.save's bytes follow
_ARRAYS_MAGIC = b"silo_pfl arrays".ljust(len(_MAGIC) - 6) + b"ghash="  # the same length
_SHA_MAGIC = b"silo_pfl arrays".ljust(len(_MAGIC) - 7) + b"sha256="  # read only: older files
_HEADER = len(_MAGIC) + 64 + 1  # the magic, the digest in hex, a newline
_CRC_MAGIC = b"silo_pfl arrays".ljust(len(_MAGIC) - 6) + b"crc32="  # read only: older files
_ALIGN = 64  # an arrays payload's buffers start this aligned: in the payload, and in memory
_CORE = "numpy._core" if np.lib.NumpyVersion(np.__version__) >= "2.0.0" else "numpy.core"
_ALLOWED = frozenset(  # all that an arrays checkpoint's pickle may name (numpy 2's and 1's)
    {
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        *(
            name
            for core in ("numpy._core", "numpy.core")
            for name in (
                (f"{core}.multiarray", "_reconstruct"),  # an array pickled in band
                (f"{core}.multiarray", "scalar"),  # a numpy scalar
                (f"{core}.numeric", "_frombuffer"),  # an array whose bytes are out of band
            )
        ),
    }
)
log = logging.getLogger("silo_pfl.checkpoint")
_open = threading.local()  # .block: this thread's durable_together block, if one is open
Buffer = bytes | bytearray | memoryview
Writer = Callable[[int], int]  # writes a file's content into its descriptor; returns its size


@dataclass
class _Block:
    """What a durable_together block wrote, and the old checkpoints it deletes once durable."""

    written: set[Path] = field(default_factory=set)
    stale: list[Path] = field(default_factory=list)


class CheckpointError(FederationError):
    """A checkpoint is missing, partial or corrupted: names the file."""


def path_of(directory: Path, round_: int, suffix: str = CHECKPOINT) -> Path:
    """Where the checkpoint (or, with suffix=MODEL, the model) of `round_` lives in `directory`."""
    return directory / f"round-{round_:06d}{suffix}"


def write_atomic(path: Path, data: bytes | Writer, reuse: Path | None = None) -> None:
    """Write `data` to a temporary file beside `path`, then rename it; on disk when this returns,
    or when the enclosing `durable_together` block ends. `data` is the bytes, or a Writer that
    writes them into the open file. `reuse`, a hidden file no longer needed (`_hidden`), is that
    temporary file, overwritten in place: nothing is freed or allocated."""
    block: _Block | None = getattr(_open, "block", None)
    if reuse is None:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    else:
        fd, tmp = os.open(reuse, os.O_WRONLY), str(reuse)
    try:
        try:
            size = data(fd) if callable(data) else _write_all(fd, data)
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
    block: _Block | None = getattr(_open, "block", None)
    if block is None:
        _fsync(path.parent)
    else:
        block.written.add(path)


def _link_atomic(path: Path, source: Path, header: bytes) -> None:
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


def _write_all(fd: int, data: Buffer) -> int:
    """Write all of `data` at the file's offset; return its size in bytes."""
    view = memoryview(data).cast("B")
    size = len(view)
    while view:
        view = view[os.write(fd, view) :]
    return size


class _HashingFile:
    """The file object torch.save (or `_arrays_save`) writes into: each tensor's or array's bytes
    go from its own memory to the file descriptor, hashed (SHA-256, or `checksum`) on the way,
    never gathered into one copy of the whole; many small writes are gathered into one."""

    GATHER = 1 << 16

    def __init__(self, fd: int | None, checksum: Callable[[], Any] = hashlib.sha256) -> None:
        self.fd, self.digest, self.size = fd, checksum(), 0  # fd None: hash, write nothing
        self._small = bytearray()

    def hexdigest(self) -> str:
        """The digest of what was written, in hex."""
        return self.digest.hexdigest()

    def write(self, data: Buffer) -> int:
        size = data.nbytes if isinstance(data, memoryview) else len(data)
        if size < self.GATHER:
            self._small += data
            if len(self._small) >= self.GATHER:
                self.flush()
        else:
            self.flush()
            self.digest.update(data)
            if self.fd is not None:
                _write_all(self.fd, data)
        self.size += size
        return size

    def flush(self) -> None:
        if self._small:
            self.digest.update(self._small)
            if self.fd is not None:
                _write_all(self.fd, self._small)
            self._small.clear()


def _torch_save(state: dict[str, Any], fd: int) -> _HashingFile:
    """torch.save's bytes of `state` written at the file's offset, in its plain pickle format
    (not its zip archive: a third cheaper for a silo's few small tensors, and read back by
    torch.load all the same)."""
    import torch  # here, not above: the server, which saves arrays, never imports torch

    out = _HashingFile(fd)
    torch.save(state, out, _use_new_zipfile_serialization=False)
    out.flush()
    return out


def _torch_load(payload: Buffer) -> Any:
    import torch

    return torch.load(io.BytesIO(payload), weights_only=True)


@functools.cache
def _allowed_ids() -> frozenset[int]:
    """The ids of the objects `_ALLOWED` names in the installed numpy (alive as long as it is)."""
    return frozenset(
        id(getattr(importlib.import_module(m), n))
        for m, n in _ALLOWED
        if m == "numpy" or m.startswith(f"{_CORE}.")
    )


class _ArraysPickler(pickle.Pickler):
    """Pickles plain containers, numpy arrays, dtypes and scalars, each array's bytes out of band
    (protocol 5); refuses (TypeError) anything else, which `_ArraysUnpickler` would not read."""

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is np.ndarray:
            _check_dtype(obj.dtype)
            flags = obj.flags
            if obj.dtype.hasobject or (
                flags.writeable and (flags.c_contiguous or flags.f_contiguous)
            ):
                return NotImplemented  # out of band as it is (an object array: in band)
            # A view of scattered memory is made contiguous, to go out of band; a read-only
            # array is copied, so that it too comes back writable.
            copy = np.array(obj, order="F" if flags.f_contiguous else "C")
            return copy.__reduce_ex__(5)
        if isinstance(obj, np.dtype):
            _check_dtype(obj)
            return NotImplemented
        if isinstance(obj, np.generic | bytearray | pickle.PickleBuffer):
            return NotImplemented
        if id(obj) in _allowed_ids():  # the functions and classes numpy's own pickles name
            return NotImplemented
        kind = type(obj)
        raise TypeError(
            f"save_arrays: cannot save a {kind.__module__}.{kind.__qualname__}: only plain "
            "containers (dict, list, tuple, set, str, bytes, int, float, bool, None), numpy "
            "arrays (not subclasses) and numpy scalars"
        )


def _check_dtype(dtype: np.dtype) -> None:
    if dtype.kind == "T":  # numpy 2's StringDType pickles through more than `_ALLOWED`
        raise TypeError(f"save_arrays: cannot save an array of {dtype}")


class _ArraysUnpickler(pickle.Unpickler):
    """Reads back what `_ArraysPickler` wrote, building nothing but what `_ALLOWED` names: like
    torch's weights_only, a file that names anything else (os.system, ...) fails to load."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in an arrays checkpoint")


def _length(size: int) -> bytes:
    return size.to_bytes(8, "little")


class _Crc32:
    """zlib's CRC-32 with hashlib's interface, in 64 hex digits: the digest of a silo's models
    written before the GHASH (read only)."""

    def __init__(self) -> None:
        self.value = 0

    def update(self, data: Buffer) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:064x}"


class _Ghash:
    """AES-GCM's tag over the data, as associated data, under a key and nonce of zeros, with
    hashlib's interface (a checksum for `_HashingFile`), in 64 hex digits: a header's digest
    field. A fixed, public key makes it a checksum, not a MAC. Up to ONE_SHOT bytes are
    gathered and tagged in one call of an AEAD made once (a file of a few kilobytes, as each of
    many small silos writes a round, costs its checksum a microsecond); more are streamed
    through a GCM context of their own, whose set-up costs more than a small file's tag."""

    ONE_SHOT = 1 << 20
    _AEAD = AESGCM(bytes(32))

    def __init__(self) -> None:
        self._gathered: bytearray | None = bytearray()
        self._gcm: Any = None

    def update(self, data: Buffer) -> None:
        gathered = self._gathered
        if gathered is not None and len(gathered) + memoryview(data).nbytes <= self.ONE_SHOT:
            gathered += data
            return
        if self._gcm is None:
            self._gcm = Cipher(algorithms.AES(bytes(32)), modes.GCM(bytes(12))).encryptor()
            self._gcm.authenticate_additional_data(gathered)
            self._gathered = None
        self._gcm.authenticate_additional_data(data)

    def hexdigest(self) -> str:
        if self._gcm is None:
            assert self._gathered is not None
            tag = self._AEAD.encrypt(bytes(12), b"", self._gathered)
        else:
            self._gcm.finalize()
            tag = self._gcm.tag
        return tag.hex().rjust(64, "0")


def _arrays_save(state: Any, fd: int | None) -> _HashingFile:
    """The arrays payload of `state` (see the module's docstring), at the file's offset: the
    pickle stream holds no array's bytes, which go from their memory to the file (fd None: only
    its digest is computed)."""
    stream, buffers = io.BytesIO(), []
    _ArraysPickler(stream, protocol=5, buffer_callback=buffers.append).dump(state)
    out = _HashingFile(fd, _Ghash)
    out.write(_length(stream.getbuffer().nbytes))
    out.write(stream.getbuffer())
    del stream
    zeros = bytes(_ALIGN)
    for buffer in buffers:
        raw = buffer.raw()
        out.write(_length(raw.nbytes))
        out.write(zeros[: -out.size % _ALIGN])
        out.write(raw)
    out.flush()
    return out


def _arrays_load(payload: memoryview) -> Any:
    """The state of an arrays payload: its arrays are views of `payload`'s own memory."""
    end = len(payload)

    def length(at: int) -> int:
        if at + 8 > end:
            raise ValueError("a length runs past the end of the payload")
        return int.from_bytes(payload[at : at + 8], "little")

    at = 8 + length(0)
    if at > end:
        raise ValueError("the pickle stream runs past the end of the payload")
    stream, buffers = payload[8:at], []
    while at < end:
        size = length(at)
        at += 8
        at += -at % _ALIGN
        if at + size > end:
            raise ValueError("a buffer runs past the end of the payload")
        buffers.append(payload[at : at + size])
        at += size
    return _ArraysUnpickler(io.BytesIO(stream), buffers=buffers).load()


def _read_aligned(handle: io.FileIO) -> memoryview:
    """The rest of the file, read into writable memory that starts at a multiple of _ALIGN."""
    size = max(os.fstat(handle.fileno()).st_size - handle.tell(), 0)
    memory = bytearray(size + _ALIGN - 1)
    start = -ctypes.addressof(ctypes.c_char.from_buffer(memory)) % _ALIGN
    view, got = memoryview(memory)[start : start + size], 0
    while got < size and (count := handle.readinto(view[got:])):
        got += count
    return view[:got]


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


def save_arrays(directory: Path, round_: int, state: Any, spare: int | None = None) -> Path:
    """Write `state` (plain containers, numpy arrays and numpy scalars) as the checkpoint of
    `round_`, without torch: its header, then its arrays payload (see the module's docstring).
    `load` gives it back, its arrays writable; anything it could not, `state` holding any other
    object, raises TypeError here and writes nothing. The file of round `spare`, if given, is
    kept beyond the newest KEEP."""
    writer = _Headed(_ARRAYS_MAGIC, _arrays_save, state)
    return _write_round(directory, round_, CHECKPOINT, writer, spare)


def save_shared(directory: Path, round_: int, state: Any, spare: int | None = None) -> str:
    """`save_arrays` for a part of a checkpoint that other parties of this process may hold
    byte for byte (the global keys of a round's model, the same in every silo a worker holds
    that evaluates the federation's global state): where this thread has just saved the same
    bytes for the same round, in a directory of the same file system, that file is hard-linked
    here, not written again. Returns the payload's digest, for the checkpoint that names this
    file to hold and `load` to check it against. Such a file is never recycled in place (its
    other links would change with it): the files beyond the newest KEEP are unlinked."""
    recent = getattr(_open, "shared", None)
    if recent is not None and recent[0] == round_:
        digest = _arrays_save(state, None).hexdigest()
        if digest == recent[1]:
            header = _ARRAYS_MAGIC + digest.encode() + b"\n"
            try:
                _write_round(
                    directory, round_, CHECKPOINT, (recent[2], header), spare, recycle=False
                )
                return digest
            except OSError:  # another file system, no hard links there, the file gone or changed
                log.debug("could not link %s into %s: writing it", recent[2], directory)
    writer = _Headed(_ARRAYS_MAGIC, _arrays_save, state)
    path = _write_round(directory, round_, CHECKPOINT, writer, spare, recycle=False)
    _open.shared = (round_, writer.digest, path)
    return writer.digest


class _Headed:
    """A Writer of a checkpoint: the payload written after room for its header, then the
    header, which holds the payload's digest (SHA-256, or the payload's own checksum), kept
    in `digest` once written."""

    def __init__(
        self, magic: bytes, payload: Callable[[Any, int], _HashingFile], state: Any
    ) -> None:
        self.magic, self.payload, self.state, self.digest = magic, payload, state, ""

    def __call__(self, fd: int) -> int:
        os.lseek(fd, _HEADER, os.SEEK_SET)
        written = self.payload(self.state, fd)
        self.digest = written.hexdigest()
        os.pwrite(fd, self.magic + self.digest.encode() + b"\n", 0)
        return _HEADER + written.size


def save_model(directory: Path, round_: int, state: dict[str, Any]) -> str:
    """Write a model's `state` as torch.save's bytes alone, for round `round_`; return their
    SHA-256, for the caller's next checkpoint to hold (`load` checks the file against it)."""
    digest = ""

    def write(fd: int) -> int:
        nonlocal digest
        written = _torch_save(state, fd)
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
    pruned; never round `spare`'s."""
    files = _files(directory, create=True)
    path = path_of(directory, round_, suffix)
    older = sorted({*files, round_})[:-KEEP]
    stale = [files[old] for old in older if old in files and old != spare]
    block: _Block | None = getattr(_open, "block", None)
    oldest = stale[0] if stale and recycle and callable(data) else None
    if oldest is not None and block is not None and oldest in block.written:
        oldest = None  # not on disk for sure yet: only a durable file is given up early
    hidden = _hidden(oldest) if oldest is not None else None
    try:
        if callable(data):
            write_atomic(path, data, hidden)
        else:
            _link_atomic(path, *data)
    except BaseException:
        if hidden is not None:
            hidden.unlink(missing_ok=True)
        raise
    pruned = stale[1:] if oldest is not None else stale
    if block is None:
        _prune(pruned)
    else:
        block.stale.extend(pruned)
    return path


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


def _digest(checksum: Callable[[], Any], data: Buffer) -> str:
    """`data`'s digest in hex, by a hashlib-like `checksum`."""
    digest = checksum()
    digest.update(data)
    return digest.hexdigest()


def load(directory: Path, round_: int, sha256: str | None = None) -> Any:
    """The checkpoint of `round_`, after checking it against its header: the arrays kind
    (`save_arrays`) with numpy arrays, torch's kind (as older silos wrote theirs) with its
    tensors; given `sha256`, its header must hold that digest (`save_shared`'s). Or the model
    of `round_` (`save_model`), checked against `sha256` when given."""
    path = _existing(directory, round_)
    if path is None:
        expected = path_of(directory, round_, CHECKPOINT if sha256 is None else MODEL)
        raise CheckpointError(f"checkpoint {expected}: not found")
    decode: Callable[[Any], Any] = _torch_load
    checksum, name = hashlib.sha256, "SHA-256"
    with open(path, "rb", buffering=0) as handle:
        if path.suffix == CHECKPOINT:
            header = handle.read(_HEADER)
            magic = header[: len(_MAGIC)]
            if len(header) < _HEADER or magic not in _KINDS or header[-1:] != b"\n":
                raise CheckpointError(f"checkpoint {path}: partial (no complete header)")
            named = header[len(_MAGIC) : -1].decode("ascii", "replace")
            if sha256 is not None and named != sha256:
                raise CheckpointError(
                    f"checkpoint {path}: not the one expected (its digest differs from the "
                    "checkpoint that names it)"
                )
            sha256, source = named, "its header"
            read, decode, checksum, name = _KINDS[magic]
            data = read(handle)
        else:
            data, source = handle.readall(), "the checkpoint that selected it"
    if sha256 is not None and _digest(checksum, data) != sha256:
        raise CheckpointError(f"checkpoint {path}: corrupted (its {name} differs from {source})")
    try:
        return decode(data)
    except Exception as exc:  # a digest that matches, but bytes that cannot be read back
        raise CheckpointError(f"checkpoint {path}: unreadable ({type(exc).__name__})") from None


# What follows each kind's header: how to read it, how to decode it, and its digest.
_KINDS: dict[bytes, tuple[Callable[[io.FileIO], Any], Callable[[Any], Any], Any, str]] = {
    _MAGIC: (io.FileIO.readall, _torch_load, hashlib.sha256, "SHA-256"),
    _ARRAYS_MAGIC: (_read_aligned, _arrays_load, _Ghash, "GHASH"),
    _SHA_MAGIC: (_read_aligned, _arrays_load, hashlib.sha256, "SHA-256"),
    _CRC_MAGIC: (_read_aligned, _arrays_load, _Crc32, "CRC-32"),
}


def load_shared(directory: Path, round_: int, digest: str) -> Any:
    """The part of a checkpoint `save_shared` wrote for `round_`, whose digest was `digest`."""
    path = path_of(directory, round_)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path}: not found")
    return load(directory, round_, digest)


def load_latest(directory: Path) -> tuple[int, Any] | None:
    """The newest good checkpoint; a newer partial or corrupted one is logged and skipped."""
    for round_ in reversed(rounds(directory)):
        try:
            return round_, load(directory, round_)
        except CheckpointError as exc:
            log.warning("%s; using the previous round's", exc)
    return None
