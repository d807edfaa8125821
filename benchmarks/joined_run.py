"""How long a run that joins a cluster takes, by the cluster's metrics export interval.

    python benchmarks/joined_run.py [--intervals 1 10] [--repeats 3] [--rounds 3]

For each interval, starts `cluster/local_cluster.py` with two hospital nodes and
`--metrics-export-interval-s` set to it, then times `silo-pfl run jobs/heart_disease.yaml`
joined to it (RAY_ADDRESS, live metrics on, as on a cluster by default; tracking off) from the
command's start to its exit, `--repeats` times. A run's end waits one export interval after its
last figures (runtime/metrics.py, DriverMetrics.settle). Prints one table: the minimum and each
repeat's seconds per interval, and the ratio of each interval's minimum to the first's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from paths import ROOT

SILOS = ("cleveland", "hungarian")
START_TIMEOUT_S = 180.0


@contextmanager
def cluster(interval: float, tmp: Path) -> Iterator[dict]:
    """local_cluster.py's info while it runs, its processes stopped after."""
    info = tmp / f"cluster-{interval:g}.json"
    command = [sys.executable, str(ROOT / "cluster" / "local_cluster.py"), *SILOS]
    command += ["--info-file", str(info), f"--metrics-export-interval-s={interval:g}"]
    proc = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        began = time.monotonic()
        while not (info.exists() and info.read_text().strip()):
            if proc.poll() is not None or time.monotonic() - began > START_TIMEOUT_S:
                raise SystemExit(f"the cluster did not come up (exit {proc.poll()})")
            time.sleep(0.2)
        yield json.loads(info.read_text())
    finally:
        proc.terminate()
        proc.wait(timeout=120)


def joined_run(info: dict, rounds: int, out: Path) -> float:
    """Seconds of one `silo-pfl run` joined to the cluster, from its start to its exit."""
    env = {**os.environ, **info["env"], "RAY_ADDRESS": info["address"]}
    command = [sys.executable, "-m", "silo_pfl", "run", "jobs/heart_disease.yaml"]
    command += [f"rounds={rounds}", "tracking.enabled=false", f"output_dir={out}", "--quiet"]
    began = time.monotonic()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.monotonic() - began
    if done.returncode != 0:
        raise SystemExit(f"the run failed: {done.stderr.strip().splitlines()[-1:]}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--intervals", type=float, nargs="+", default=[1.0, 10.0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    times: dict[float, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for interval in args.intervals:
            with cluster(interval, Path(tmp)) as info:
                out = Path(tmp) / "runs"
                times[interval] = [joined_run(info, args.rounds, out) for _ in range(args.repeats)]
    first = min(times[args.intervals[0]])
    print(f"`silo-pfl run jobs/heart_disease.yaml rounds={args.rounds}` joined to a cluster of")
    print(f"{len(SILOS)} silo nodes, seconds from start to exit\n")
    print("| export interval | min | repeats | min / first's min |")
    print("|---|---|---|---|")
    for interval, seconds in times.items():
        each = ", ".join(f"{s:.2f}" for s in seconds)
        print(f"| {interval:g} s | {min(seconds):.2f} | {each} | {min(seconds) / first:.2f} |")


if __name__ == "__main__":
    main()
