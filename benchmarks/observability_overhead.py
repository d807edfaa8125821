"""Cost of live metrics and the run report, as the median ratio of alternating pairs of runs.

    python benchmarks/observability_overhead.py [jobs/digits_label_skew.yaml] [--pairs 5]
        [key=value ...]

Each run is the CLI in a fresh process (`silo-pfl run JOB --quiet`), tracked in a temporary
SQLite store, timed from its start to its exit: what a user waits for. The "on" side has
metrics.enabled=true and tracking.report=true: a 1 s export interval for every process of the
local Ray, the service-discovery file, every figure recorded in the actors and on the driver,
the check for a last scrape (no Prometheus scrapes here, so the run does not wait for one: see
the README's "Timing"), and the HTML report with its figures logged to the run. The "off" side
has both false. The order alternates (off/on, on/off, ...); the figure to read is the median of
the pair ratios, which one pair disturbed by other work on the machine cannot move.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import job_parser, run_main
from paths import ROOT


def timed_run(job: str, overrides: list[str], on: bool, tmp: Path) -> float:
    """Wall seconds of one CLI run, from its start to its exit."""
    flag = str(on).lower()
    argv = [
        sys.executable,
        "-m",
        "silo_pfl",
        "run",
        job,
        *overrides,
        f"metrics.enabled={flag}",
        f"tracking.report={flag}",
        f"tracking.uri=sqlite:///{tmp / 'mlflow.db'}",
        f"output_dir={tmp / 'runs'}",
        "--quiet",
    ]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = str(ROOT)
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"run failed ({'on' if on else 'off'}): {done.stderr.strip()[-2000:]}")
    return wall


def main() -> None:
    parser = job_parser(__doc__, "jobs/digits_label_skew.yaml")
    parser.add_argument("--pairs", type=int, default=5)
    args = parser.parse_args()
    seconds: dict[bool, list[float]] = {False: [], True: []}
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        timed_run(args.job, [*args.overrides, "rounds=1"], False, Path(tmp))  # the store, caches
        for pair in range(args.pairs):
            order = (False, True) if pair % 2 == 0 else (True, False)
            for on in order:
                seconds[on].append(timed_run(args.job, args.overrides, on, Path(tmp)))
                state = "on " if on else "off"
                print(f"pair {pair + 1} {state}: {seconds[on][-1]:6.2f}s", flush=True)
            ratios.append(seconds[True][-1] / seconds[False][-1])
            print(f"pair {pair + 1} ratio on/off: {ratios[-1]:.3f}", flush=True)
    total_on, total_off = sum(seconds[True]), sum(seconds[False])
    print(
        f"metrics + report: median pair ratio on/off {statistics.median(ratios):.3f} over "
        f"{args.pairs} pairs; sum on / sum off {total_on / total_off:.3f} "
        f"({total_on:.1f}s / {total_off:.1f}s)"
    )


if __name__ == "__main__":
    run_main(main)
