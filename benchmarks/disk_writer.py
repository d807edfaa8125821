"""Another process writing to a file system, as other work on a silo's server might: 512 MiB
files, over and over, without syncing, so that the kernel always holds some of its pages
dirty."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

_WRITER = """
import sys
chunk = bytes(1 << 20)
while True:
    with open(sys.argv[1], "wb") as handle:
        for _ in range(512):
            handle.write(chunk)
"""


@contextlib.contextmanager
def other_writer(directory: Path, warm_up_s: float = 3.0) -> Iterator[None]:
    """A process writing into `directory` for the block's duration; stopped, and its file
    removed, as the block ends."""
    target = directory / "other_writer.bin"
    writer = subprocess.Popen([sys.executable, "-c", _WRITER, str(target)])
    try:
        time.sleep(warm_up_s)  # until its dirty pages reach the kernel's writeback
        yield
    finally:
        writer.kill()
        writer.wait()
        target.unlink(missing_ok=True)
