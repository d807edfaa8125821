"""A fresh large array's first touch with numpy's huge page advice and without it.

    python benchmarks/huge_pages.py [--values 1182208] [--calls 1000] [--batches 3]

Times `silo_pfl.secure.fixed_point.encode` of one silo's update of --values float32 values (the
secure benchmark's 1.2M by default: a fresh 9.5 MB output and its float32 gathering, every
call), --calls calls a batch, keeping the last five outputs alive as a worker keeps a round's
masked updates. Batches alternate between numpy's default, which advises the kernel to back
each array of 4 MB or more with huge pages, and no advice, which the silo and server workers
use (silo_pfl.runtime.huge_pages). Prints, per batch, the median, the 99th percentile and the
slowest call, and their mean, in ms.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from silo_pfl.runtime.huge_pages import set_advice
from silo_pfl.secure.fixed_point import encode


def batch(values: int, calls: int, advice: bool) -> list[float]:
    """Milliseconds of each of `calls` encodes, with numpy's huge page advice on or off."""
    set_advice(advice)
    rng = np.random.default_rng(0)
    payload = {"update": rng.standard_normal(values, dtype=np.float32) * 0.01}
    kept: list[np.ndarray] = []
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        kept.append(encode(payload, 100, 10, "silo_0"))
        times.append(1000 * (time.perf_counter() - start))
        del kept[:-5]
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--values", type=int, default=1_182_208)
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--batches", type=int, default=3)
    args = parser.parse_args()
    print(f"\nencode of {args.values:,} values, {args.calls} calls a batch; ms\n")
    print("| batch | huge page advice | median | p99 | slowest | mean |\n|---|---|---|---|---|---|")
    for number in range(2 * args.batches):
        advice = number % 2 == 0
        times = sorted(batch(args.values, args.calls, advice))
        p99 = times[int(0.99 * (len(times) - 1))]
        print(
            f"| {number + 1} | {'numpy default' if advice else 'off'} | "
            f"{statistics.median(times):.1f} | {p99:.1f} | {times[-1]:.1f} | "
            f"{statistics.mean(times):.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
