"""Work on a long vector cut into slices, each on its own thread.

numpy's arithmetic and `cryptography`'s ciphers release the GIL on large blocks, so slices of one
vector run on as many cores as the process has. Each slice is worked exactly as the whole would
be, block by block, so the result does not depend on the number of threads.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

# Threads for work the other parties wait on (the server's sum and unmasking): its cores, at most 4.
CORES = max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1))


PAGE = 4096  # bytes: the smallest page the kernel maps


def fault_in(array: np.ndarray) -> None:
    """Write one byte of each page of a new `array` here, on one thread, before several threads
    write it all. Threads that fault on the pages of one fresh allocation together can stall
    in the kernel for many times the work itself (with transparent huge pages, in memory
    compaction), where one thread faults on them at a steady cost."""
    array.reshape(-1).view(np.uint8)[::PAGE] = 0


def bounds(size: int, unit: int, parts: int) -> list[int]:
    """Cut points splitting [0, size) into at most `parts` slices of whole `unit`s."""
    units = -(-size // unit)
    parts = max(1, min(parts, units))
    return [min(size, unit * (units * i // parts)) for i in range(parts + 1)]


def for_slices(size: int, unit: int, threads: int, work: Callable[[int, int], None]) -> None:
    """work(first, end) over slices of [0, size) that start at multiples of `unit`, on up to
    `threads` threads (on this one, if one); the first error is raised here."""
    cuts = bounds(size, unit, threads)
    if len(cuts) <= 2:
        work(0, size)
        return
    with ThreadPoolExecutor(len(cuts) - 1) as pool:
        list(pool.map(lambda pair: work(*pair), itertools.pairwise(cuts)))
