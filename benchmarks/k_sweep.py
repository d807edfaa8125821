"""The FedPer paper's K sweep: fedper keeping the last K blocks local (split.local=[last:K]).

    python benchmarks/k_sweep.py jobs/digits_label_skew.yaml [key=value ...] \
        --models cnn_small transformer --ks 1 2 3 4 --seed 0 [--rounds transformer=40] \
        [--out docs/results/issue10_k_sweep.json]

For each model and K it runs the job with `algorithm.name=fedper model.name=<model>
split.local=[last:K]` (tracking off) and prints K, the modules kept local (models.blocks: last:1 is
the head), the mean and worst per-silo test accuracy, the mean validation accuracy and the bytes
each silo sends per round; a K whose split the config refuses (last:K holding every block leaves
nothing to federate) is a row saying so. `--rounds MODEL=N` caps one model's rounds. With --out
and a file already there, the rows are added to it (a list per job; a row of the same model and K
is replaced), so one file holds several jobs and models, each row with its overrides and seed.
The key names are read from the model built for the job's 8x8 digits ((1, 8, 8)); they do not
depend on the input shape, and each run's global keys are checked against them.
"""

from __future__ import annotations

import json
import os
import tempfile

import numpy as np
from common import job_parser, run_main, start_local_ray

from silo_pfl.algorithms import build_algorithm
from silo_pfl.errors import ConfigError
from silo_pfl.federation import Federation
from silo_pfl.models import block_of, build_model
from silo_pfl.settings import load_config
from silo_pfl.split import compute_split

PROBE_SHAPE = (1, 8, 8)


def local_modules(cfg) -> tuple[list[str], list[str]]:
    """The top-level modules (body.X, head) the split keeps local, and the global keys."""
    algorithm = build_algorithm(cfg.algorithm, cfg.train)
    model = build_model(cfg.model.name, PROBE_SHAPE, 10, cfg.model.hidden, cfg.model.adapter_dim)
    model = algorithm.prepare_model(model)
    split = compute_split(model, list(cfg.split.local))
    owner = block_of(model)
    modules = [m for m in owner if any(k.startswith(m + ".") for k in split.local_keys)]
    return modules, list(split.global_keys)


def main() -> None:
    parser = job_parser(__doc__)
    parser.add_argument("--models", nargs="+", default=["cnn_small", "transformer"])
    parser.add_argument("--ks", nargs="+", type=int, default=[1, 2, 3, 4])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", nargs="*", default=[], help="MODEL=N: cap that model's rounds")
    parser.add_argument("--out", help="write (or add to) the table as JSON here")
    args = parser.parse_args()
    caps = {model: int(n) for model, n in (item.split("=") for item in args.rounds)}
    start_local_ray()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        runs = []  # every config is checked before the first run
        for model in args.models:
            for k in args.ks:
                overrides = [
                    "tracking.enabled=false",
                    *args.overrides,
                    "algorithm.name=fedper",
                    f"model.name={model}",
                    f"split.local=[last:{k}]",
                    f"seed={args.seed}",
                    f"output_dir={tmp}",
                    *([f"rounds={caps[model]}"] if model in caps else []),
                ]
                try:
                    runs.append((model, k, load_config(args.job, overrides)))
                except ConfigError as exc:  # e.g. last:K holding every block: nothing to share
                    rows.append({"model": model, "k": k, "refused": str(exc)})
                    print(f"{model} last:{k}: refused: {exc}", flush=True)
        for model, k, cfg in runs:
            modules, global_keys = local_modules(cfg)
            result = Federation(cfg).run()
            assert sorted(np.load(result.global_state_path).files) == sorted(global_keys)
            silo = next(iter(result.silos.values()))
            row = {
                "model": model,
                "k": k,
                "rounds": cfg.rounds,
                "local_modules": modules,
                "local_parameters": result.local_parameters,
                "global_parameters": result.global_parameters,
                "mean_test_accuracy": result.mean_test_accuracy,
                "worst_test_accuracy": result.worst_test_accuracy,
                "mean_val_accuracy": float(
                    np.mean([s.val_accuracy for s in result.silos.values()])
                ),
                "bytes_per_round": silo.bytes_sent_per_round,
                "wall_seconds": result.wall_seconds,
            }
            rows.append(row)
            print(
                f"{model} last:{k}: mean {row['mean_test_accuracy']:.4f} worst "
                f"{row['worst_test_accuracy']:.4f} val {row['mean_val_accuracy']:.4f} "
                f"({result.wall_seconds:.1f}s)",
                flush=True,
            )
    rows.sort(key=lambda row: (args.models.index(row["model"]), row["k"]))
    print(f"\n{args.job} {' '.join(args.overrides)} seed {args.seed}")
    print(
        f"{'model':<12}{'K':>2}  {'kept local':<40}{'rounds':>7}{'mean':>8}{'worst':>8}"
        f"{'val':>8}{'bytes/round':>13}"
    )
    for row in rows:
        if "refused" in row:
            reason = row["refused"].split(": ", 2)[-1].split(";")[0]
            print(f"{row['model']:<12}{row['k']:>2}  refused: {reason}")
            continue
        print(
            f"{row['model']:<12}{row['k']:>2}  {', '.join(row['local_modules']):<40}"
            f"{row['rounds']:>7}{row['mean_test_accuracy']:>8.4f}{row['worst_test_accuracy']:>8.4f}"
            f"{row['mean_val_accuracy']:>8.4f}{row['bytes_per_round']:>13,}"
        )
    if args.out:
        table: dict[str, list[dict]] = {}
        if os.path.exists(args.out):
            with open(args.out) as fh:
                table = json.load(fh)
        for row in rows:
            row |= {"overrides": args.overrides, "seed": args.seed}
        new = {(row["model"], row["k"]) for row in rows}
        kept = [row for row in table.get(args.job, []) if (row["model"], row["k"]) not in new]
        table[args.job] = kept + rows
        with open(args.out, "w") as fh:
            json.dump(table, fh, indent=2)


if __name__ == "__main__":
    run_main(main)
