"""A checkpoint file's bytes: a header line holding a digest of the rest (the payload), then
the payload, of one of two kinds, which the header's magic (its text before the digest) tells
apart, so that a reader needs no argument to read any.

- Arrays (`arrays_save`): plain containers, numpy arrays and numpy scalars: every checkpoint
  written now. Header `silo_pfl arrays ghash=<hex>` (padded to the torch header's length). The
  payload is pickle protocol 5 with each array's bytes out of band: the stream's length (8
  bytes, little-endian), the stream, then each buffer as its length (8 bytes) and its bytes,
  zero-padded before them so that they start at a multiple of 64 bytes into the payload. The
  arrays go from their own memory to the file (only a read-only or non-contiguous one is copied
  first), and come back writable and 64-byte aligned, views of one buffer the size of the file.
  They are read back by an unpickler that builds nothing but numpy arrays, dtypes and scalars
  (`_ALLOWED`), and `arrays_save` refuses, before it writes, anything that would need more. The
  digest is a GHASH: AES-GCM's tag over the payload as associated data, under a key and nonce
  of zeros, a 128-bit polynomial checksum that OpenSSL computes with carry-less multiplication,
  several times faster than a SHA-256 or zlib's CRC-32 (docs/BENCHMARKS.md): a large model's
  file costs its checksum a fraction of its writing. It catches a flipped, lost or moved byte,
  not a forgery; no digest without a secret key would, and nothing but its party writes a
  checkpoint directory. Arrays files written before under a SHA-256 (`silo_pfl arrays
  sha256=`) or a CRC-32 (`silo_pfl arrays      crc32=`) are still read and checked, so that a
  run resumes across the change.
- Read only: torch.save's bytes of plain containers and tensors, read back with
  `weights_only=True`, as silos of earlier versions wrote their checkpoints. Header `silo_pfl
  checkpoint sha256=<hex>`: their SHA-256. (`torch_save` still writes a selected model's plain
  file, torch.save's bytes alone, which MLflow ships and serves.)
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib
import io
import os
import pickle
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from silo_pfl.durable import Buffer, write_all

MAGIC = b"silo_pfl checkpoint sha256="  # torch.save's bytes follow
ARRAYS_MAGIC = b"silo_pfl arrays".ljust(len(MAGIC) - 6) + b"ghash="  # the same length
_SHA_MAGIC = b"silo_pfl arrays".ljust(len(MAGIC) - 7) + b"sha256="  # read only: older files
HEADER = len(MAGIC) + 64 + 1  # the magic, the digest in hex, a newline
_CRC_MAGIC = b"silo_pfl arrays".ljust(len(MAGIC) - 6) + b"crc32="  # read only: older files
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


class HashingFile:
    """The file object torch.save (or `arrays_save`) writes into: each tensor's or array's bytes
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
                write_all(self.fd, data)
        self.size += size
        return size

    def flush(self) -> None:
        if self._small:
            self.digest.update(self._small)
            if self.fd is not None:
                write_all(self.fd, self._small)
            self._small.clear()


def torch_save(state: dict[str, Any], fd: int) -> HashingFile:
    """torch.save's bytes of `state` written at the file's offset, in its plain pickle format
    (not its zip archive: a third cheaper for a silo's few small tensors, and read back by
    torch.load all the same)."""
    import torch  # here, not above: the server, which saves arrays, never imports torch

    out = HashingFile(fd)
    torch.save(state, out, _use_new_zipfile_serialization=False)
    out.flush()
    return out


def torch_load(payload: Buffer) -> Any:
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


class Ghash:
    """AES-GCM's tag over the data, as associated data, under a key and nonce of zeros, with
    hashlib's interface (a checksum for `HashingFile`), in 64 hex digits: a header's digest
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


def arrays_save(state: Any, fd: int | None) -> HashingFile:
    """The arrays payload of `state` (see the module's docstring), at the file's offset: the
    pickle stream holds no array's bytes, which go from their memory to the file (fd None: only
    its digest is computed)."""
    stream, buffers = io.BytesIO(), []
    _ArraysPickler(stream, protocol=5, buffer_callback=buffers.append).dump(state)
    out = HashingFile(fd, Ghash)
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


class Headed:
    """A Writer of a checkpoint: the payload written after room for its header, then the
    header, which holds the payload's digest (SHA-256, or the payload's own checksum), kept
    in `digest` once written."""

    def __init__(
        self, magic: bytes, payload: Callable[[Any, int], HashingFile], state: Any
    ) -> None:
        self.magic, self.payload, self.state, self.digest = magic, payload, state, ""

    def __call__(self, fd: int) -> int:
        os.lseek(fd, HEADER, os.SEEK_SET)
        written = self.payload(self.state, fd)
        self.digest = written.hexdigest()
        os.pwrite(fd, self.magic + self.digest.encode() + b"\n", 0)
        return HEADER + written.size


def digest_of(checksum: Callable[[], Any], data: Buffer) -> str:
    """`data`'s digest in hex, by a hashlib-like `checksum`."""
    digest = checksum()
    digest.update(data)
    return digest.hexdigest()


# What follows each kind's header: how to read it, how to decode it, and its digest.
KINDS: dict[bytes, tuple[Callable[[io.FileIO], Any], Callable[[Any], Any], Any, str]] = {
    MAGIC: (io.FileIO.readall, torch_load, hashlib.sha256, "SHA-256"),
    ARRAYS_MAGIC: (_read_aligned, _arrays_load, Ghash, "GHASH"),
    _SHA_MAGIC: (_read_aligned, _arrays_load, hashlib.sha256, "SHA-256"),
    _CRC_MAGIC: (_read_aligned, _arrays_load, _Crc32, "CRC-32"),
}
