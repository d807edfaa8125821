"""The CPU an idle Ray takes from the machine: the tests' loopback cluster, and one local node.

    python benchmarks/idle_cluster.py [--seconds 20] [--repeats 3]

Samples the CPU time of every process on the machine (/proc), so run it on a quiet machine:
first with nothing started (the baseline), then with the test suite's loopback cluster up and
idle (`tests/loopback_cluster.py`: `cluster/local_cluster.py`'s head, a node per hospital and an
MLflow server), then with a local Ray as the suite's `ray_local` starts it (one node, no
dashboard). Prints one table, in cores: what each takes while it does nothing.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import ray

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from loopback_cluster import start

SETTLE_S = 10.0  # after a start, before sampling: the start's own work is over


def machine_cpu_seconds() -> float:
    """User and system CPU seconds of every live process on the machine."""
    ticks = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def idle_cores(seconds: float, repeats: int) -> list[float]:
    """The machine's CPU use, in cores, over `repeats` windows of `seconds`."""
    samples = []
    for _ in range(repeats):
        cpu, began = machine_cpu_seconds(), time.monotonic()
        time.sleep(seconds)
        samples.append((machine_cpu_seconds() - cpu) / (time.monotonic() - began))
    return samples


def measured(name: str, up: Callable[[], Callable[[], None]], args: argparse.Namespace) -> str:
    """A table row: `up()` starts something and returns how to stop it."""
    down = up()
    try:
        time.sleep(SETTLE_S)
        samples = idle_cores(args.seconds, args.repeats)
    finally:
        down()
    return f"| {name} | {min(samples):.3f} | {max(samples):.3f} |"


def loopback_cluster() -> Callable[[], None]:
    running = start(Path(tempfile.mkdtemp(prefix="idle_cluster")))
    next(running)
    return lambda: next(running, None)


def local_ray() -> Callable[[], None]:
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        logging_level=logging.WARNING,
        _system_config={"metrics_report_interval_ms": 1000},
    )
    return ray.shutdown


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows = [measured("nothing started (baseline)", lambda: lambda: None, args)]
    rows.append(measured("the tests' loopback cluster, idle", loopback_cluster, args))
    rows.append(measured("a local Ray as `ray_local` starts it, idle", local_ray, args))
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"\nthe machine's CPU use in cores, {args.repeats} windows of {args.seconds:g} s each "
        f"after {SETTLE_S:g} s to settle; load average {load}\n"
    )
    print("| running | cores (min) | cores (max) |\n|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
