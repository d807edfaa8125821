"""Cold start: silos held out of training join the trained federation with few rows.

    python benchmarks/onboarding.py jobs/digits_label_skew.yaml --late silo_8 silo_9 \
        --seeds 0 1 2 --max-train-rows 50 [key=value ...] [--out docs/results/onboarding.json]

For each seed: the federation trains without the late silos (tracking in a temporary SQLite
store), then each late silo onboards with data.max_train_rows rows and, beside it, trains alone.
Prints each onboarding's test accuracy against the founders' mean and against training alone.
The key=value overrides apply to the training and to each onboarding (whose seed and data.*
must be the trained run's); overrides of the onboarding alone (e.g. rounds=10) follow `--onboard`.
"""

from __future__ import annotations

import argparse
import json
import tempfile

import numpy as np
from common import run_main, start_local_ray

from silo_pfl.federation import Federation
from silo_pfl.settings import load_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("job")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the training")
    parser.add_argument("--late", nargs="+", required=True, help="silos held out, then onboarded")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--max-train-rows", type=int, default=50)
    parser.add_argument("--onboard", nargs="*", default=[], help="key=value of the onboarding")
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args()
    start_local_ray()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            common = [
                f"seed={seed}",
                f"data.late_silos=[{','.join(args.late)}]",
                f"tracking.uri=sqlite:///{tmp}/mlflow.db",
                f"output_dir={tmp}/runs",
            ]
            trained = Federation(load_config(args.job, [*args.overrides, *common])).run()
            for silo in args.late:
                cfg = load_config(  # the training's overrides too: its data, model, training
                    args.job,
                    [
                        *args.overrides,
                        *common,
                        f"data.max_train_rows={args.max_train_rows}",
                        *args.onboard,
                    ],
                )
                report = Federation(cfg).onboard(silo).extras["onboard"]
                rows.append({"seed": seed, "train_seconds": trained.wall_seconds, **report})
                print(
                    f"seed {seed} {silo}: onboarded {report['test_accuracy']:.4f}, founders "
                    f"{report['founders_mean_test_accuracy']:.4f} "
                    f"({100 * report['share_of_founders_mean']:.1f}%), alone "
                    f"{report['alone_test_accuracy']:.4f} "
                    f"(gain {100 * report['gain_over_alone']:+.1f} points)",
                    flush=True,
                )
    share = [r["share_of_founders_mean"] for r in rows]
    gain = [r["gain_over_alone"] for r in rows]
    print(
        f"share of founders' mean: mean {100 * np.mean(share):.1f}%, min {100 * min(share):.1f}%; "
        f"gain over alone: mean {100 * np.mean(gain):+.1f}, min {100 * min(gain):+.1f} points"
    )
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(rows, fh, indent=2)


if __name__ == "__main__":
    run_main(main)
