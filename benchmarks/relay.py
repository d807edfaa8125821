"""The relay: how long a round's silos wait between its last fit and its first evaluation,
while the updates reach the server, are summed, and the sum reaches the silos.

    python benchmarks/relay.py [--rounds 41] [--repeats 3] [key=value ...]

Runs `jobs/digits_label_skew.yaml` as FedAvg (tracking off, default packing: 10 silos on the
cores' workers) on a local Ray, with the algorithm `fedavg_marked` (`relay_marks.py`), which notes
the wall time at which each silo's training of a round ends and its evaluation begins. A round's
relay is its first evaluation's start less its last training's end, across the worker
processes of this one machine (one clock). Prints, per run, the median, the 25th and the 75th
percentile over rounds 3.. (the first rounds pay the actors' first calls), and the median round.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections import defaultdict
from pathlib import Path

from common import RoundClock, run_main, start_local_ray
from paths import in_repo

from silo_pfl.federation import Federation
from silo_pfl.settings import load_config

JOB = in_repo("jobs/digits_label_skew.yaml")
BASE = ["algorithm.name=fedavg_marked", "plugins=[relay_marks]", "tracking.enabled=false"]
SKIP = 2  # rounds left out


def relays(notes: Path) -> list[float]:
    """Each round's relay in seconds, from the notes of every worker process, rounds SKIP+1.."""
    times: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for path in notes.iterdir():
        for line in path.read_text().splitlines():
            what, round_, at = line.split()
            times[int(round_)][what].append(float(at))
    return [
        min(times[r]["eval_start"]) - max(times[r]["fit_end"])
        for r in sorted(times)
        if r > SKIP and times[r]["eval_start"] and times[r]["fit_end"]
    ]


def run(overrides: list[str], rounds: int) -> tuple[list[float], list[float]]:
    """One run's relays and round seconds."""
    clock = RoundClock()
    with tempfile.TemporaryDirectory() as tmp:
        notes = Path(tmp) / "notes"
        notes.mkdir()
        config = load_config(
            JOB,
            [
                *BASE,
                f"algorithm.fedavg_marked.marker_dir={notes}",
                *overrides,
                f"rounds={rounds}",
                f"output_dir={tmp}",
            ],
        )
        Federation(config, callbacks=[clock]).run()
        return relays(notes), clock.round_seconds()[SKIP:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("overrides", nargs="*", default=[])
    args = parser.parse_args()
    if args.rounds < SKIP + 2:
        parser.error(
            f"--rounds: got {args.rounds}, expected at least {SKIP + 2} "
            f"(rounds 1-{SKIP} are left out)"
        )
    start_local_ray()
    print("| run | relay: median (ms) | 25th | 75th | round: median (ms) |\n|---|---|---|---|---|")
    for repeat in range(1, args.repeats + 1):
        relay, rounds = run(args.overrides, args.rounds)
        q1, _, q3 = statistics.quantiles(relay, n=4)
        print(
            f"| {repeat} | {1000 * statistics.median(relay):.2f} | {1000 * q1:.2f} | "
            f"{1000 * q3:.2f} | {1000 * statistics.median(rounds):.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    run_main(main)
