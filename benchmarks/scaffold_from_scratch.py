"""SCAFFOLD written from scratch beside the package's, on a job's data: when a run diverges,
is it the algorithm or the package?

From scratch: Karimireddy et al. (2020), Algorithm 1, option II, every silo in every round,
over `limit.PlainSilo` (the package's data, initial model, batches and SGD). Each local step
follows g + c - c_i; after K steps c_i+ = c_i - c + (x - y) / (lr * steps_moved(K, m)), which is
the paper's K * lr without momentum; the server moves x by the row-weighted mean delta and c by
the row-weighted mean of the Delta c_i, as the package does (the paper's plain mean, where silos
hold equal rows). FedAvg is the same without the correction. The package runs
`Federation(cfg).run()` on a local Ray, with tracking off.

Each cell is the mean validation accuracy of the last round's model over the silos (the global
model: neither algorithm has local keys), or the round in which training diverged (a loss or a
weight not finite; the package's run then ends without a quorum).

    python benchmarks/scaffold_from_scratch.py --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import math
import tempfile
from collections.abc import Sequence

import numpy as np
import torch
from common import start_local_ray
from limit import PlainSilo, State
from paths import in_repo

from silo_pfl.aggregation import apply_delta, weighted_mean
from silo_pfl.algorithms.scaffold import steps_moved
from silo_pfl.data import silo_names
from silo_pfl.errors import FederationError
from silo_pfl.federation import Federation
from silo_pfl.settings import load_config

JOB = "jobs/digits_label_skew.yaml"
SETTINGS = (
    "train.lr=0.05 train.momentum=0.9",
    "train.lr=0.05 train.momentum=0",
    "train.lr=0.2 train.momentum=0",
)


def from_scratch(job: str, overrides: Sequence[str], scaffold: bool) -> str:
    """The last round's mean validation accuracy, or the round that diverged."""
    cfg = load_config(job, [*overrides, "tracking.enabled=false"])
    torch.set_num_threads(cfg.train.torch_threads)  # as a silo's worker: the same float sums
    silos = [PlainSilo(cfg, name) for name in silo_names(cfg.data)]
    state: State = {k: v.numpy().copy() for k, v in silos[0].model.state_dict().items()}
    keys = [name for name, _ in silos[0].model.named_parameters()]
    c = {k: torch.zeros_like(torch.from_numpy(state[k])) for k in keys}
    c_i = {s.name: {k: v.clone() for k, v in c.items()} for s in silos}
    lr, momentum = cfg.train.lr, cfg.train.momentum
    for round_ in range(1, cfg.rounds + 1):
        deltas, rows, moves = [], [], []
        for silo in silos:
            correction = {k: c[k] - c_i[silo.name][k] for k in keys} if scaffold else None
            delta, n = silo.fit(state, round_, correction)
            if not math.isfinite(silo.loss) or not all(
                np.isfinite(d).all() for d in delta.values()
            ):
                return f"diverged (round {round_})"
            deltas.append(delta)
            rows.append(n)
            if scaffold:
                moved = lr * steps_moved(silo.steps, momentum)
                new = {
                    k: c_i[silo.name][k] - c[k] - torch.from_numpy(delta[k]) / moved for k in keys
                }
                moves.append({k: new[k] - c_i[silo.name][k] for k in keys})
                c_i[silo.name] = new
        state = apply_delta(state, weighted_mean(deltas, rows))
        if scaffold:  # every silo in every round: the row-weighted mean of the Delta c_i
            pairs = list(zip(rows, moves, strict=True))
            c = {k: c[k] + sum(n * m[k] for n, m in pairs) / sum(rows) for k in keys}
    return f"{np.mean([silo.evaluate(state)[0][0] for silo in silos]):.3f}"


def package(job: str, overrides: Sequence[str]) -> str:
    """The package's run: the last round's mean validation accuracy, or the round it ended in."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(job, [*overrides, "tracking.enabled=false", f"output_dir={tmp}"])
        try:
            result = Federation(cfg).run()
        except FederationError as exc:
            return f"diverged ({str(exc).split(':')[0]})"
    return f"{result.history[-1].mean_val_accuracy:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--job", default=JOB)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS))
    args = parser.parse_args()
    job = in_repo(args.job)
    start_local_ray()
    print(
        f"\n{args.job}, last round's mean validation accuracy over the silos\n\n"
        "| setting | seed | SCAFFOLD, the package | SCAFFOLD, from scratch | "
        "FedAvg, the package | FedAvg, from scratch |\n|---|---|---|---|---|---|"
    )
    for setting in args.settings:
        for seed in args.seeds:
            cells = []
            for algorithm in ("scaffold", "fedavg"):
                overrides = [*setting.split(), f"seed={seed}", f"algorithm.name={algorithm}"]
                cells += [
                    package(job, overrides),
                    from_scratch(job, overrides, algorithm == "scaffold"),
                ]
            print(f"| {setting} | {seed} | {' | '.join(cells)} |", flush=True)


if __name__ == "__main__":
    main()
