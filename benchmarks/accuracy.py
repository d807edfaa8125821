"""Mean per-silo test accuracy of algorithms on a job, over seeds, in one Ray session.

    python benchmarks/accuracy.py jobs/heart_disease.yaml --algorithms fedper fedavg local \
        --seeds 0 1 2 3 4 [key=value ...] [--out docs/results/heart_disease.json]
"""

from __future__ import annotations

import json
import tempfile

import numpy as np
from common import job_parser, start_local_ray

from silo_pfl.config import load_config
from silo_pfl.federation import Federation


def main() -> None:
    parser = job_parser(__doc__)
    parser.add_argument("--algorithms", nargs="+", default=["fedper", "fedavg"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--out", help="write the table as JSON here")
    args = parser.parse_args()
    start_local_ray()
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for algorithm in args.algorithms:
            runs = []
            for seed in args.seeds:
                cfg = load_config(
                    args.job,
                    [
                        "tracking.enabled=false",
                        *args.overrides,
                        f"algorithm.name={algorithm}",
                        f"seed={seed}",
                        f"output_dir={tmp}",
                    ],
                )
                result = Federation(cfg).run()
                runs.append(result)
                print(
                    f"{algorithm:<8} seed {seed}: mean {result.mean_test_accuracy:.4f} worst "
                    f"{result.worst_test_accuracy:.4f} ({result.wall_seconds:.1f}s)",
                    flush=True,
                )
            means = [r.mean_test_accuracy for r in runs]
            rows[algorithm] = {
                "mean_test_accuracy": float(np.mean(means)),
                "std_over_seeds": float(np.std(means)),
                "worst_test_accuracy": float(np.mean([r.worst_test_accuracy for r in runs])),
                "max_wall_seconds": float(max(r.wall_seconds for r in runs)),
                "per_seed": means,
            }
    print(f"\n{args.job} {' '.join(args.overrides)} seeds {args.seeds}")
    print(f"{'algorithm':<10}{'mean acc':>10}{'± seeds':>9}{'worst':>8}{'max s':>8}")
    for name, row in rows.items():
        print(
            f"{name:<10}{row['mean_test_accuracy']:>10.4f}{row['std_over_seeds']:>9.4f}"
            f"{row['worst_test_accuracy']:>8.4f}{row['max_wall_seconds']:>8.1f}"
        )
    gaps = _gaps(rows, args.seeds)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(
                {
                    "job": args.job,
                    "overrides": args.overrides,
                    "seeds": args.seeds,
                    "results": rows,
                    "gaps": gaps,
                },
                fh,
                indent=2,
            )


def _gaps(rows: dict[str, dict], seeds: list[int]) -> dict[str, dict]:
    """The first algorithm minus each other one, in points, per seed and over the seeds; printed."""
    names = list(rows)
    gaps = {}
    for other in names[1:]:
        per_seed = [
            100 * (a - b)
            for a, b in zip(rows[names[0]]["per_seed"], rows[other]["per_seed"], strict=True)
        ]
        gaps[other] = {"per_seed_points": per_seed, "mean_points": float(np.mean(per_seed))}
        listed = ", ".join(f"seed {s}: {g:+.1f}" for s, g in zip(seeds, per_seed, strict=True))
        print(f"{names[0]} - {other}: {np.mean(per_seed):+.1f} points on average ({listed})")
    return gaps


if __name__ == "__main__":
    main()
