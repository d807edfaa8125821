"""What each step of a round costs a worker per silo, at many silos, in one process.

    python benchmarks/silo_steps.py [--silos 64] [--rounds 20] [key=value ...]

`jobs/digits_label_skew.yaml algorithm.name=fedavg model.name=mlp data.num_silos=N` (as
`benchmarks/scale.py` runs it): the silos and the server in this process, no Ray, each round
every silo fits, the server aggregates, every silo evaluates, and every silo commits keeping its
model (its selected model and its checkpoint, all in one durable block, as a worker's call makes
them). Prints the microseconds per silo of each step, median over the rounds after the first 3.
At 64 silos a silo holds about 20 training rows, so this is the fixed work a silo adds to a
round, which decides how round time grows with the silos (the scale target).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from common import in_process_federation, run_main
from paths import in_repo

from silo_pfl import durable
from silo_pfl.settings import load_config

JOB = in_repo("jobs/digits_label_skew.yaml")
BASE = ["algorithm.name=fedavg", "model.name=mlp", "tracking.enabled=false"]
WARM_UP = 3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--silos", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("overrides", nargs="*", help="key=value overrides")
    args = parser.parse_args()
    steps: dict[str, list[float]] = {"fit": [], "evaluate": [], "commit": []}
    with tempfile.TemporaryDirectory() as tmp:
        overrides = [*BASE, f"data.num_silos={args.silos}", f"output_dir={tmp}", *args.overrides]
        silos, server = in_process_federation(load_config(JOB, overrides))
        for round_ in range(1, WARM_UP + args.rounds + 1):
            began = time.perf_counter()
            updates = [silo.fit(server.global_state(), round_)[0] for silo in silos]
            fitted = time.perf_counter()
            server.aggregate(*updates)
            state = server.global_state()
            evaluating = time.perf_counter()
            for silo in silos:
                silo.evaluate(state, round_)
            committing = time.perf_counter()
            with durable.durable_together():
                for silo in silos:
                    silo.commit(round_, keep=True)
            ended = time.perf_counter()
            server.checkpoint(round_, {})
            if round_ > WARM_UP:
                steps["fit"].append(fitted - began)
                steps["evaluate"].append(committing - evaluating)
                steps["commit"].append(ended - committing)
    per_silo = {k: statistics.median(v) / args.silos * 1e6 for k, v in steps.items()}
    print(
        f"{args.silos} silos in one process, median of rounds {WARM_UP + 1}-{WARM_UP + args.rounds}"
    )
    print("| us per silo | fit | evaluate | commit (keeping its model) |")
    print("|---|---|---|---|")
    print(f"| | {per_silo['fit']:.0f} | {per_silo['evaluate']:.0f} | {per_silo['commit']:.0f} |")


if __name__ == "__main__":
    run_main(main)
