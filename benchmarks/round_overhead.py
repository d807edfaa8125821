"""What the Ray runtime costs per round, against the same silos run in one plain process.

    python benchmarks/round_overhead.py [JOB] [key=value ...]

Both sides do the same work (every silo fits, the server aggregates, every silo evaluates and
commits, their checkpoints reaching the disk together as a worker's do, and the server
checkpoints) with the same classes; the in-process side calls them one after another, the Ray
side runs the silos in their workers. Rounds after the first are compared (the first includes
actor start-up), as a ratio measured in the same run, with and without training
(train.local_epochs=0 isolates the fixed cost of a round).
"""

from __future__ import annotations

import statistics
import tempfile
import time

from common import in_process_federation, job_parser, run_main, start_local_ray

from silo_pfl import durable
from silo_pfl.federation import Federation
from silo_pfl.selection import Selector
from silo_pfl.settings import load_config


def in_process(cfg) -> list[float]:
    """Seconds per round with every silo in this process, one after another."""
    silos, server = in_process_federation(cfg)
    selector = Selector(cfg.eval.selection)
    selected: dict[str, int | None] = {silo.name: None for silo in silos}
    state = server.global_state()
    seconds = []
    for round_ in range(1, cfg.rounds + 1):
        began = time.perf_counter()
        updates = [silo.fit(state, round_)[0] for silo in silos]
        server.aggregate(*updates)
        state = server.global_state()
        with durable.durable_together():  # as a worker's one call for its silos
            evals = [s.evaluate_and_commit(state, round_, selected[s.name]) for s in silos]
        selected.update(dict.fromkeys(selector.choose(evals), round_))
        server.checkpoint(round_, {})
        seconds.append(time.perf_counter() - began)
    return seconds


def main() -> None:
    parser = job_parser(__doc__, "jobs/digits_label_skew.yaml")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    start_local_ray()
    print(f"{args.job} {' '.join(args.overrides)}, {args.rounds} rounds, median of rounds 2..")
    with tempfile.TemporaryDirectory() as tmp:
        for label, extra in (
            ("with training", []),
            ("no training", ["train.local_epochs=0", "algorithm.fedper.head_warmup_epochs=0"]),
        ):
            cfg = load_config(
                args.job,
                [
                    *args.overrides,
                    *extra,
                    f"rounds={args.rounds}",
                    f"output_dir={tmp}",
                    "tracking.enabled=false",
                ],
            )
            plain = statistics.median(in_process(cfg)[1:])
            began = time.perf_counter()
            result = Federation(cfg).run()
            total = time.perf_counter() - began
            on_ray = statistics.median(r.seconds for r in result.history[1:])
            first = result.history[0].seconds
            print(
                f"{label:<14} in-process {plain * 1000:7.1f} ms/round  ray {on_ray * 1000:7.1f} "
                f"ms/round  ratio {on_ray / plain:5.2f}x  (ray round 1 {first:.1f} s, "
                f"whole run {total:.1f} s)",
                flush=True,
            )


if __name__ == "__main__":
    run_main(main)
