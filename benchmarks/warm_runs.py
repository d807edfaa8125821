"""Runs one after another in one Ray session: with workers kept warm between them, and without.

    python benchmarks/warm_runs.py [--runs 4] [key=value ...]

In one Python process with one local Ray (`ray.init`, as a notebook, a sweep or `silo-pfl
compare`'s worker has), runs `jobs/digits_label_skew.yaml algorithm.name=fedavg
tracking.enabled=false rounds=1` --runs times with `runtime.host_pool` keeping workers (the
product's behaviour), then --runs times with it keeping none (every run starts its workers, as
before), alternating the two blocks twice. Prints the seconds of each `Federation(config).run()`
and the median of the runs after the first of each block.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time

import ray
from paths import in_repo

from silo_pfl.federation import Federation
from silo_pfl.runtime import host_pool
from silo_pfl.settings import load_config

JOB = in_repo("jobs/digits_label_skew.yaml")
BASE = ["algorithm.name=fedavg", "tracking.enabled=false", "rounds=1"]


def block(runs: int, keep: int, overrides: list[str]) -> list[float]:
    """Seconds of each of `runs` runs with at most `keep` idle workers kept between them."""
    host_pool.KEEP = keep
    seconds = []
    for _ in range(runs):
        with tempfile.TemporaryDirectory() as tmp:
            cfg = load_config(JOB, [*BASE, *overrides, f"output_dir={tmp}"])
            began = time.perf_counter()
            Federation(cfg).run()
            seconds.append(time.perf_counter() - began)
    host_pool.drain()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)
    kept, fresh = [], []
    for _ in range(2):
        kept.append(block(args.runs, 4, args.overrides))
        fresh.append(block(args.runs, 0, args.overrides))
    ray.shutdown()
    print(f"{JOB} {' '.join(BASE + args.overrides)}; seconds per Federation(config).run()")
    print("| workers | runs (two blocks) | median after each block's first |")
    print("|---|---|---|")
    medians = {}
    for name, blocks in (("kept warm", kept), ("started each run", fresh)):
        medians[name] = statistics.median([s for b in blocks for s in b[1:]])
        runs = " / ".join(", ".join(f"{s:.2f}" for s in b) for b in blocks)
        print(f"| {name} | {runs} | {medians[name]:.2f} |")
    ratio = medians["started each run"] / medians["kept warm"]
    print(f"started each run / kept warm: {ratio:.2f}x")


if __name__ == "__main__":
    main()
