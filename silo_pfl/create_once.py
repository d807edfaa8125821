"""Files created whole and at most once, even by processes racing to create them."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def create_once(path: Path, data: bytes) -> bool:
    """Write `data` to `path` unless it exists; True if this call created it.

    The bytes go to a private (0600) temporary file beside `path`, synced, then hard-linked into
    place: a reader never sees a partial file, and of processes racing exactly one returns True.
    """
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.link(temporary, path)
    except FileExistsError:
        return False
    finally:
        os.unlink(temporary)
    return True
