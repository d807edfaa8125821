"""Cost of MLflow tracking + per-silo model registration, as a ratio measured in one process.

    python benchmarks/tracking_overhead.py [jobs/heart_disease.yaml] [--pairs 3] [key=value ...]

Runs the job with tracking off and on, alternately (off/on, on/off, ...), in one Ray session,
and times each `Federation(config).run()` end to end: opening the store, the rounds, every
silo's export and registration. The first tracked run also pays the driver's MLflow import and
the new SQLite store's creation; every tracked run pays each silo process's own MLflow set-up.
Prints each pair's ratio, the overall ratio (sum of tracked / sum of untracked seconds) and
the median of the pair ratios, which one pair disturbed by other work on the machine cannot move.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import ray
from common import job_parser, run_main, start_local_ray

from silo_pfl.federation import Federation
from silo_pfl.settings import load_config


def timed_run(job: str, overrides: list[str], tracking: bool, tmp: Path) -> tuple[float, float]:
    """Wall seconds of one run, and its mean test accuracy."""
    cfg = load_config(
        job,
        [
            *overrides,
            f"tracking.enabled={str(tracking).lower()}",
            f"tracking.uri=sqlite:///{tmp / 'mlflow.db'}",
            f"output_dir={tmp / 'runs'}",
        ],
    )
    start = time.perf_counter()
    result = Federation(cfg).run()
    return time.perf_counter() - start, result.mean_test_accuracy


def main() -> None:
    parser = job_parser(__doc__, "jobs/heart_disease.yaml")
    parser.add_argument("--pairs", type=int, default=3)
    args = parser.parse_args()
    start_local_ray()
    seconds: dict[bool, list[float]] = {False: [], True: []}
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        for pair in range(args.pairs):
            order = (False, True) if pair % 2 == 0 else (True, False)
            for tracking in order:
                wall, accuracy = timed_run(args.job, args.overrides, tracking, Path(tmp))
                seconds[tracking].append(wall)
                state = "on " if tracking else "off"
                print(
                    f"pair {pair + 1} tracking {state}: {wall:6.2f}s  mean test acc {accuracy:.4f}",
                    flush=True,
                )
            ratios.append(seconds[True][-1] / seconds[False][-1])
            print(f"pair {pair + 1} ratio on/off: {ratios[-1]:.2f}", flush=True)
    ray.shutdown()
    total_on, total_off = sum(seconds[True]), sum(seconds[False])
    print(
        f"tracking overhead ratio (sum on / sum off over {args.pairs} pairs): "
        f"{total_on / total_off:.2f}  ({total_on:.1f}s / {total_off:.1f}s); "
        f"median pair ratio {statistics.median(ratios):.2f}"
    )


if __name__ == "__main__":
    run_main(main)
