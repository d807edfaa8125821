"""Mean per-silo test accuracy of algorithms on a job, over seeds, in one Ray session.

    python benchmarks/accuracy.py jobs/heart_disease.yaml --algorithms fedper fedavg local \
        --seeds 0 1 2 3 4 [key=value ...] [--baseline local] [--out docs/results/heart_disease.json]

Besides test accuracy it prints each algorithm's mean validation accuracy (the figure to tune on)
and each silo's test accuracy over the seeds; with --baseline, each silo's gain over that
algorithm (the "no silo left behind" check: the worst silo's gain, and the mean gain).
An algorithm may carry its own overrides: `ditto:algorithm.ditto.lam=0.5` (a label with `@`:
`ditto@lam0.5:algorithm.ditto.lam=0.5`), separated by commas outside brackets:
`"fedper@attn:split.local=[pattern:body.block2.attn.*,head],train.lr=0.01"`.
"""

from __future__ import annotations

import json
import tempfile

import numpy as np
from common import job_parser, run_main, start_local_ray

from silo_pfl.federation import Federation
from silo_pfl.settings import load_config


def main() -> None:
    parser = job_parser(__doc__)
    parser.add_argument("--algorithms", nargs="+", default=["fedper", "fedavg"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--out", help="write the table as JSON here")
    parser.add_argument("--baseline", help="an algorithm of --algorithms to compare each silo to")
    args = parser.parse_args()
    labels = [_spec(spec)[0] for spec in args.algorithms]  # `label:overrides` runs as label
    if args.baseline is not None and args.baseline not in labels:
        parser.error(
            f"--baseline {args.baseline}: expected one of --algorithms ({', '.join(labels)})"
        )
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        plans = {}  # every config checked before Ray starts: a misspelt one is refused at once
        for spec in args.algorithms:
            label, own = _spec(spec)
            algorithm = label.split("@")[0]
            common = ["tracking.enabled=false", *args.overrides, f"algorithm.name={algorithm}"]
            plans[label] = (
                own,
                [
                    (
                        seed,
                        load_config(args.job, [*common, *own, f"seed={seed}", f"output_dir={tmp}"]),
                    )
                    for seed in args.seeds
                ],
            )
        start_local_ray()
        for label, (own, configs) in plans.items():
            runs = []
            for seed, cfg in configs:
                result = Federation(cfg).run()
                runs.append(result)
                print(
                    f"{label:<8} seed {seed}: mean {result.mean_test_accuracy:.4f} worst "
                    f"{result.worst_test_accuracy:.4f} val {_val(result):.4f} "
                    f"({result.wall_seconds:.1f}s)",
                    flush=True,
                )
            means = [r.mean_test_accuracy for r in runs]
            silos = list(runs[0].silos)
            rows[label] = {
                "overrides": own,
                "mean_val_accuracy": float(np.mean([_val(r) for r in runs])),
                "per_silo": {
                    s: float(np.mean([r.silos[s].test_accuracy for r in runs])) for s in silos
                },
                "mean_test_accuracy": float(np.mean(means)),
                "std_over_seeds": float(np.std(means)),
                "worst_test_accuracy": float(np.mean([r.worst_test_accuracy for r in runs])),
                "max_wall_seconds": float(max(r.wall_seconds for r in runs)),
                "per_seed": means,
            }
    print(f"\n{args.job} {' '.join(args.overrides)} seeds {args.seeds}")
    print(f"{'algorithm':<14}{'mean acc':>10}{'± seeds':>9}{'worst':>8}{'val':>8}{'max s':>8}")
    for name, row in rows.items():
        print(
            f"{name:<14}{row['mean_test_accuracy']:>10.4f}{row['std_over_seeds']:>9.4f}"
            f"{row['worst_test_accuracy']:>8.4f}{row['mean_val_accuracy']:>8.4f}"
            f"{row['max_wall_seconds']:>8.1f}"
        )
    _per_silo(rows, args.baseline)
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


def _spec(spec: str) -> tuple[str, list[str]]:
    """'label:key=value,key=value' -> (label, overrides); a bare name has none. A comma inside
    brackets belongs to its value (split.local=[a,b])."""
    label, _, rest = spec.partition(":")
    items, depth, current = [], 0, ""
    for char in rest:
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += char
    return label, [item for item in [*items, current] if item]


def _val(result) -> float:
    """Mean over silos of the selected model's validation accuracy."""
    return float(np.mean([s.val_accuracy for s in result.silos.values()]))


def _per_silo(rows: dict[str, dict], baseline: str | None) -> None:
    """Each silo's test accuracy over the seeds; with a baseline, each silo's gain over it."""
    silos = list(next(iter(rows.values()))["per_silo"])
    print(f"\n{'per silo':<14}" + "".join(f"{s[:10]:>11}" for s in silos))
    for name, row in rows.items():
        print(f"{name:<14}" + "".join(f"{row['per_silo'][s]:>11.4f}" for s in silos))
    if baseline is None:
        return
    base = rows[baseline]["per_silo"]
    print(f"\n{'gain (points)':<14}" + "".join(f"{s[:10]:>11}" for s in silos) + "   worst   mean")
    for name, row in rows.items():
        gains = [100 * (row["per_silo"][s] - base[s]) for s in silos]
        row["gain_over_baseline"] = {"baseline": baseline, "per_silo_points": gains}
        print(
            f"{name:<14}"
            + "".join(f"{g:>+11.1f}" for g in gains)
            + f"{min(gains):>+8.1f}{np.mean(gains):>+7.1f}"
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
    run_main(main)
