"""Steady-state seconds per round against the limit: the same SGD in plain PyTorch, a process per
core.

    python benchmarks/rounds.py [--rounds 11] [--repeats 3]
                                [--wide model.name=mlp model.hidden=[1024,1024]]

Two bodies: `jobs/digits_label_skew.yaml algorithm.name=fedavg` as it is (cnn_small, 10 silos,
2 local epochs of SGD with momentum, batches of 32), and the same job with a wide body where
compute dominates (--wide; cnn_small has fixed widths and ignores model.hidden, so the wide body
is the mlp's, widened by override). Tracking off, default packing.

- federation: `Federation(config).run()` on a local Ray started once; a callback notes when each
  round ends (after its aggregation, evaluations, commits and the server's checkpoint), so a
  round's seconds are the time between two round ends, everything included.
- limit (benchmarks/limit.py): FedAvg's arithmetic alone in plain PyTorch, the silos dealt over P
  worker processes as packing deals them, with P = the number of cores and P = 1. Its final
  global model must equal the federation's bit for bit (last column): both did the same work.
- Ray alone (benchmarks/ray_limit.py): the limit's P = cores workers as Ray actors, one call
  each a round, on the same Ray as the federation: the floor of a round on Ray, without
  anything silo_pfl adds (the server actor, checkpoints, metrics, the round's rules).

Steady state: the median over rounds 2..R. Every time is the minimum over --repeats runs of
each side (the four sides alternate, each started once the shared machine is quiet:
benchmarks/machine.py). Ratios: federation / limit (target <= 1.15 for cnn_small), Ray alone /
limit (what Ray itself costs the same rounds), federation / Ray alone (what silo_pfl adds), and
the parallel efficiency T(limit, 1 process) / (cores x T(federation)), which is 1 when the
federation uses the cores as perfectly parallel SGD would (target >= 0.9 on the wide body). The
limit's own efficiency, T(limit, 1 process) / (cores x T(limit, cores)), is what the
machine allows at the time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from collections.abc import Sequence

import numpy as np
from common import RoundClock, run_main, start_local_ray
from limit import State, run_limit, same_model
from machine import load_average, wait_for_quiet
from paths import in_repo
from ray_limit import run_ray_limit

from silo_pfl.federation import Federation
from silo_pfl.settings import load_config

JOB = in_repo("jobs/digits_label_skew.yaml")
BASE = ["algorithm.name=fedavg", "tracking.enabled=false"]
WIDE = ["model.name=mlp", "model.hidden=[1024,1024]"]


def federation(overrides: Sequence[str], rounds: int) -> tuple[list[float], State]:
    """Seconds of each round of the federation, and its final global model."""
    clock = RoundClock()
    with tempfile.TemporaryDirectory() as tmp:
        config = load_config(JOB, [*overrides, f"rounds={rounds}", f"output_dir={tmp}"])
        result = Federation(config, callbacks=[clock]).run()
        with np.load(result.global_state_path) as saved:
            state = {k: saved[k] for k in saved.files}
    return clock.round_seconds(), state


def steady(seconds: Sequence[float]) -> float:
    """The median round after the first."""
    return statistics.median(seconds[1:])


def measure(label: str, overrides: list[str], rounds: int, repeats: int) -> str:
    """One table row: the minima over `repeats` of each side."""
    cores = os.cpu_count() or 1
    fed, bare, par, one, identical = [], [], [], [], True
    for _ in range(repeats):
        wait_for_quiet()
        seconds, fed_state = federation(overrides, rounds)
        fed.append(steady(seconds))
        wait_for_quiet()
        seconds, bare_state = run_ray_limit(JOB, overrides, rounds, cores)
        bare.append(steady(seconds))
        wait_for_quiet()
        seconds, par_state = run_limit(JOB, overrides, rounds, cores)
        par.append(steady(seconds))
        wait_for_quiet()
        seconds, one_state = run_limit(JOB, overrides, rounds, 1)
        one.append(steady(seconds))
        identical &= all(same_model(fed_state, s) for s in (bare_state, par_state, one_state))
        print(
            f"  {label}: fed {fed[-1]:.3f} ray {bare[-1]:.3f} limit {par[-1]:.3f} "
            f"one {one[-1]:.3f}",
            flush=True,
        )
    f, b, p, o = min(fed), min(bare), min(par), min(one)
    return (
        f"| {label} | {f * 1000:.0f} | {b * 1000:.0f} | {p * 1000:.0f} | **{f / p:.2f}x** | "
        f"{b / p:.2f}x | {f / b:.2f}x | {o * 1000:.0f} | **{o / (cores * f):.2f}** | "
        f"{o / (cores * p):.2f} | {'yes' if identical else 'NO'} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--wide", nargs="+", default=WIDE, help="overrides of the wide body")
    args = parser.parse_args()
    start_local_ray()
    cores = os.cpu_count() or 1
    rows = [
        measure("cnn_small", BASE, args.rounds, args.repeats),
        measure(" ".join(args.wide), [*BASE, *args.wide], args.rounds, args.repeats),
    ]
    print(
        f"\n{JOB} algorithm.name=fedavg, 10 silos, {cores} cores; ms per round, median of rounds "
        f"2-{args.rounds}, minimum of {args.repeats} runs; load average {load_average()}\n"
    )
    print(
        f"| body | federation | Ray alone | limit, {cores} processes | federation / limit "
        "| Ray alone / limit | federation / Ray alone | limit, 1 process | parallel efficiency "
        "| limit's own efficiency | same final model |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    run_main(main)
