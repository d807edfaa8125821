"""A durable block's end, by one sync of the file system or by fsyncs, with the disk quiet and
while another process writes to the same file system.

    python benchmarks/sync_under_writer.py [--silos 5] [--size 100000] [--repeats 30]

Each block writes `--silos` files of `--size` bytes, each in a directory of its own (as a
worker's silos commit a round), inside `durable.durable_together`, and ends either by
`syncfs` (what the block does where the OS has it) or by an fsync of each file and directory
(its way without syncfs). The other writer (`disk_writer.other_writer`) writes 512 MiB files
over and over beside them, without syncing, as other work on a silo's server might; a file
system's sync also waits for its dirty pages. The two ways alternate; prints the median, p90
and slowest ms a block.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
from pathlib import Path

from disk_writer import other_writer

from silo_pfl import durable


def _block(folders: list[Path], payload: bytes, syncfs: bool) -> float:
    """Seconds for one block's writes and its end."""
    saved = durable._SYNCFS
    if not syncfs:
        durable._SYNCFS = None
    try:
        began = time.perf_counter()
        with durable.durable_together():
            for folder in folders:
                durable.write_atomic(folder / "state.bin", payload)
        return time.perf_counter() - began
    finally:
        durable._SYNCFS = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--silos", type=int, default=5)
    parser.add_argument("--size", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    if durable._SYNCFS is None:
        raise SystemExit("this OS has no syncfs: nothing to compare")
    payload = os.urandom(args.size)
    print(f"{args.silos} files of {args.size} bytes a block, each in its own directory; ms")
    print("| disk | block's end | median | p90 | slowest |\n|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(dir=Path.cwd()) as tmp:
        folders = [Path(tmp) / f"silo_{i}" for i in range(args.silos)]
        for folder in folders:
            folder.mkdir()
        for disk in ("quiet", "another process writing"):
            with other_writer(Path(tmp)) if disk != "quiet" else contextlib.nullcontext():
                for syncfs in (True, False, True, False):
                    times = sorted(
                        1000 * _block(folders, payload, syncfs) for _ in range(args.repeats)
                    )
                    p90 = times[int(0.9 * (len(times) - 1))]
                    way = "syncfs" if syncfs else "fsync each file and directory"
                    print(
                        f"| {disk} | {way} | {statistics.median(times):.1f} | {p90:.1f} | "
                        f"{times[-1]:.1f} |"
                    )


if __name__ == "__main__":
    main()
