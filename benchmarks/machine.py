"""The shared machine benchmarks run on: its load, and waiting for a quiet moment.

Other engineers' tests share the cores. A benchmark waits, before each measurement, until the
whole machine has been nearly idle for a moment (its own idle Ray included), so that a minimum of
a few runs is a run the others left alone. Imports nothing heavy: a benchmark that times its own
imports may import it first.
"""

from __future__ import annotations

import os
import sys
import time

QUIET_BUSY = 0.15  # the share of all cores' time in use below which the machine counts as quiet
QUIET_WAIT_S = float(os.environ.get("BENCH_QUIET_WAIT_S", "900"))  # at most, per measurement
SAMPLE_S = 2.0


def load_average() -> str:
    """The machine's 1, 5 and 15 minute load averages, for a table's caption."""
    return ", ".join(f"{value:.2f}" for value in os.getloadavg())


def _cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of all cores since boot, from /proc/stat."""
    with open("/proc/stat") as handle:
        fields = [int(v) for v in handle.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def busy_fraction(seconds: float = SAMPLE_S) -> float:
    """The share of all cores' time spent busy over the next `seconds`."""
    busy, total = _cpu_times()
    time.sleep(seconds)
    busy_after, total_after = _cpu_times()
    return (busy_after - busy) / max(1, total_after - total)


def wait_for_quiet(limit_s: float = QUIET_WAIT_S, busy: float = QUIET_BUSY) -> bool:
    """Wait until the machine is nearly idle (less than `busy` of its cores in use over a few
    seconds), at most `limit_s`; False, and a note on stderr, if it never was."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if busy_fraction() < busy:
            return True
    print(f"  (the machine stayed busy for {limit_s:.0f} s; measuring anyway)", file=sys.stderr)
    return False
