"""Where a round's milliseconds go, as the driver sees them: each step of a round timed.

    python benchmarks/round_steps.py [JOB] [key=value ...] [--rounds 10] [--disk-writer]

Runs JOB (default `jobs/digits_label_skew.yaml algorithm.name=fedavg tracking.enabled=false`) with
`Federation(config).run()` on a local Ray, with the driver's waits wrapped in timers: each silo
step (`call_many` of fit, evaluate_and_commit and, under aggregation.secure, advertise,
share_keys, unmask) from the driver's wait for it to its last answer (a round's fits, sent ahead
with the previous round's aggregation, are already running by then), the server's calls
(aggregation, and under secure its enrolment, routing and unmasking), the server's round
checkpoint, and the whole round between two `on_round_end`s. Prints the median of rounds 3.. of
each (and of the server's checkpoint over the last 5 rounds, since what it writes may grow; and
the mean and the slowest of the rounds, where a stall shows that the median hides), and per
silo worker (as default packing deals them) the sum of its silos' `train_seconds`: the fits'
own work, one silo after another. With `--disk-writer`, another process writes to the run's
file system throughout (`disk_writer.py`), as other work on a silo's server might.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from disk_writer import other_writer
from paths import in_repo

from silo_pfl.callbacks import Callback
from silo_pfl.data import silo_names
from silo_pfl.federation import Federation
from silo_pfl.runtime import aggregation_steps, orchestrator, rounds
from silo_pfl.runtime.packing import pack
from silo_pfl.settings import load_config

JOB = in_repo("jobs/digits_label_skew.yaml")
DEFAULT = ["algorithm.name=fedavg", "tracking.enabled=false"]
SKIP = 2  # rounds whose figures are left out: the actors' first calls are slower
LATE = 5  # the last rounds, for what grows with the history

times: dict[str, list[float]] = defaultdict(list)
_methods: dict[str, str] = {}  # the ids of each silo call's refs: the method that made them


def _hex(ref: Any) -> str:
    """The id of a ref, or of the object a `Shared` answer is an item of."""
    return getattr(ref, "ref", ref).hex()


def _timed_call_many(original: Any) -> Any:
    def call_many(handles: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        out = original(handles, method, *args, **kwargs)
        _methods.update({_hex(ref): method for refs in out.values() for ref in refs})
        return out

    return call_many


def _timed_gather(refs: dict[str, Any], timeout: float) -> Any:
    began = time.perf_counter()
    out = _gather(refs, timeout)
    method = next((_methods.get(_hex(r), "") for r in refs.values()), "") or "?"
    times[f"silos: {method}"].append(time.perf_counter() - began)
    return out


def _timed_get(refs: Any, what: str, timeout: float | None = None, names: Any = ()) -> Any:
    began = time.perf_counter()
    out = _get(refs, what, timeout, names)
    times[f"server: {what.split(': ', 1)[-1]}"].append(time.perf_counter() - began)
    return out


def _timed_checkpoint(self: Any, server: Any, round_: int, *args: Any) -> None:
    began = time.perf_counter()
    _checkpoint(self, server, round_, *args)
    if round_ > 0:  # round 0's, before the first round, is not a round's
        times["server: round checkpoint"].append(time.perf_counter() - began)


_gather, _get, _checkpoint = (
    rounds.gather,
    aggregation_steps.get,
    orchestrator.Orchestrator._checkpoint,
)
rounds.gather = _timed_gather
rounds.call_many = _timed_call_many(rounds.call_many)
aggregation_steps.call_many = _timed_call_many(aggregation_steps.call_many)
aggregation_steps.get = _timed_get
orchestrator.Orchestrator._checkpoint = _timed_checkpoint


class RoundEnds(Callback):
    """Notes when each round ends."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_round_end(self, summary: Any) -> None:
        self.ends.append(time.perf_counter())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("job", nargs="?", default=JOB)
    parser.add_argument("overrides", nargs="*", default=DEFAULT)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument(
        "--disk-writer",
        action="store_true",
        help="another process writes to the run's file system throughout (disk_writer.py)",
    )
    args = parser.parse_args()
    clock = RoundEnds()
    with tempfile.TemporaryDirectory() as tmp:
        overrides = [*args.overrides, f"rounds={args.rounds}", f"output_dir={tmp}"]
        config = load_config(args.job, overrides)
        writing = other_writer(Path(tmp)) if args.disk_writer else contextlib.nullcontext()
        with writing:
            result = Federation(config, callbacks=[clock]).run()
    times["round (between round ends)"] = [
        b - a for a, b in zip(clock.ends[:-1], clock.ends[1:], strict=True)
    ]
    print(f"{args.job} {' '.join(args.overrides)}: ms, median of rounds {SKIP + 1}-{args.rounds}")
    print("| step | ms |\n|---|---|")
    for step, seconds in times.items():
        kept = seconds[SKIP:] if step.startswith(("silos", "server")) else seconds[SKIP - 1 :]
        if kept:
            print(f"| {step} | {1000 * statistics.median(kept):.1f} |")
    rounds = times["round (between round ends)"][SKIP - 1 :]
    mean, slowest = 1000 * statistics.mean(rounds), 1000 * max(rounds)
    print(f"| round: mean / slowest | {mean:.1f} / {slowest:.1f} |")
    late = 1000 * statistics.median(times["server: round checkpoint"][-LATE:])
    print(f"| server: round checkpoint, last {LATE} rounds | {late:.1f} |")
    workers = pack(config, silo_names(config.data), os.cpu_count() or 1)
    sums = [
        statistics.median(
            sum(summary.silos[n]["train_seconds"] for n in worker if n in summary.silos)
            for summary in result.history[SKIP:]
        )
        for worker in workers
    ]
    print(
        f"| the fits' own work, per worker (sum of its silos' train_seconds) | "
        f"{' / '.join(f'{1000 * s:.1f}' for s in sums)} |"
    )


if __name__ == "__main__":
    main()
