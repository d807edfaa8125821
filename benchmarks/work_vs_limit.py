"""The federation's own work per round against the plain-PyTorch limit's, in one process, no Ray.

    python benchmarks/work_vs_limit.py [JOB] [key=value ...] [--rounds 15]

Default: `jobs/digits_label_skew.yaml algorithm.name=fedavg tracking.enabled=false` (cnn_small,
10 silos). One thread. Each round runs both sides, one after the other:
- the federation's classes: every `Silo` fits, the `Server` aggregates, every silo evaluates and
  commits (their checkpoints reaching the disk together, as a worker's do), the server
  checkpoints;
- the limit's (benchmarks/limit.py): every `PlainSilo` evaluates and fits, then the mean.

So the ratio is what the federation's code costs over FedAvg's arithmetic, with no runtime and
no parallelism. `benchmarks/rounds.py` measures the whole on Ray, against the limit on as many
processes as cores. The rest of that ratio is the runtime and the round's structure.
Rounds after the third count (median).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable

import numpy as np
import torch
from common import in_process_federation, job_parser, run_main
from limit import PlainSilo

from silo_pfl import durable
from silo_pfl.aggregation import apply_delta, weighted_mean
from silo_pfl.selection import Selector
from silo_pfl.settings import load_config

BASE = ["algorithm.name=fedavg", "tracking.enabled=false"]
FEDERATION = ("fit", "aggregate", "evaluate and commit", "server checkpoint")
LIMIT = ("limit: evaluate", "limit: fit", "limit: mean")


def main() -> None:
    parser = job_parser(__doc__, "jobs/digits_label_skew.yaml")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    if args.rounds < 5:
        raise SystemExit("--rounds: at least 5 (rounds 1-3 are not counted)")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        measure(args.job, args.overrides, args.rounds, tmp)


def measure(job: str, extra: list[str], rounds: int, out_dir: str) -> None:
    """Both sides' rounds, the federation's files in `out_dir`; prints the table."""
    overrides = [*BASE, *extra, f"output_dir={out_dir}"]
    cfg = load_config(job, overrides)
    silos, server = in_process_federation(cfg)
    selector = Selector(cfg.eval.selection)
    selected: dict[str, int | None] = {silo.name: None for silo in silos}
    plain = [PlainSilo(cfg, silo.name) for silo in silos]
    state: dict[str, np.ndarray] = {
        k: v.numpy().copy() for k, v in plain[0].model.state_dict().items()
    }
    spent: dict[str, list[float]] = {step: [] for step in (*FEDERATION, *LIMIT)}

    def timed(step: str, work: Callable[[], object]) -> object:
        began = time.perf_counter()
        result = work()
        spent[step].append(time.perf_counter() - began)
        return result

    for round_ in range(1, rounds + 1):
        fits = timed("fit", lambda r=round_: [s.fit(server.global_state(), r) for s in silos])
        timed("aggregate", lambda f=fits: server.aggregate(*[u for u, _ in f]))

        def evaluate_and_commit(r: int = round_) -> list:
            with durable.durable_together():
                state = server.global_state()
                return [s.evaluate_and_commit(state, r, selected[s.name]) for s in silos]

        evals = timed("evaluate and commit", evaluate_and_commit)
        selected.update(dict.fromkeys(selector.choose(sorted(evals, key=lambda e: e.silo)), round_))
        timed("server checkpoint", lambda r=round_: server.checkpoint(r, {}))
        timed("limit: evaluate", lambda s=state: [p.evaluate(s) for p in plain])
        deltas = timed("limit: fit", lambda s=state, r=round_: [p.fit(s, r) for p in plain])
        state = timed(
            "limit: mean",
            lambda s=state, d=deltas: apply_delta(
                s, weighted_mean([x for x, _ in d], [n for _, n in d])
            ),
        )
    median = {step: statistics.median(seconds[3:]) * 1e3 for step, seconds in spent.items()}
    federation = sum(median[step] for step in FEDERATION)
    limit = sum(median[step] for step in LIMIT)
    print(f"{job} {' '.join(overrides[:-1])}: ms per round, median of rounds 4-{rounds}")
    print("| step | ms |\n|---|---|")
    for step, ms in median.items():
        print(f"| {step} | {ms:.1f} |")
    print(f"| **federation** | {federation:.1f} |\n| **limit** | {limit:.1f} |")
    print(f"| **federation / limit** | {federation / limit:.2f} |")


if __name__ == "__main__":
    run_main(main)
