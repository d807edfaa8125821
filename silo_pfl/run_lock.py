"""One driver at a time per run: the server of a run holds an exclusive lock on its directory
for as long as it serves the run, so that a second `--resume` of the same run, started while the
first still runs, is refused in one line instead of writing the same checkpoints and round log.
The lock is the kernel's (flock), so it goes with the server's process, however that ends."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from silo_pfl.errors import FederationError

LOCK_FILE = ".lock"
# directory -> the open file whose lock this process holds, and how many holders share it
_held: dict[Path, list[int]] = {}


def hold(directory: Path, run_id: str) -> None:
    """Take the lock of `directory` (created if absent) for this process, or raise naming the
    process that holds it. Held already by this process (a server built again): counted, and
    let go with the last `release`."""
    directory = directory.resolve()
    if directory in _held:
        _held[directory][1] += 1
        return
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise FederationError(
            f"run {run_id}: another driver is running it (the server of pid {holder} holds "
            f"{path}); stop that run or wait for it to end, then --resume"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    _held[directory] = [fd, 1]


def release(directory: Path) -> None:
    """One holder of `directory`'s lock lets go; the last one closes it."""
    held = _held.get(directory.resolve())
    if held is None:
        return
    held[1] -= 1
    if held[1] == 0:
        del _held[directory.resolve()]
        os.close(held[0])
