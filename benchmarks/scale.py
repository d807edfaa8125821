"""How a federation on one machine scales with its silos: 10, 32, 64 and 128 digits silos.

    python benchmarks/scale.py [--silos 10 32 64 128] [--rounds 6] [--repeats 3]

`jobs/digits_label_skew.yaml algorithm.name=fedavg model.name=mlp tracking.enabled=false
data.num_silos=N` (pathological: 2 classes per silo; the mlp's default hidden layer of 32),
default packing (`ray.silos_per_worker=auto`: one worker per core), on one local Ray started once.
For each N:

- start-up: from `Federation.run()` to the end of the set-up (every worker started, every silo's
  data loaded and model built), on an already running Ray;
- seconds per round: the median of rounds 2..R, a round ending after its checkpoint. R is
  --rounds at the largest N, and more at smaller N, so that every N runs as many silo-rounds
  (R = --rounds x largest N / N): a 10-silo round lasts a few tens of milliseconds, and the
  median of five of them moved by a third from one run to the next;
- the work: the digits are 1797 rows whatever N, so every round trains on the same rows; what
  grows with N is the number of batches (each silo's last one is partial: 14 rows at 128 silos
  are one batch per epoch) and the per-silo steps of a round. The limit (benchmarks/limit.py,
  FedAvg's arithmetic alone in plain PyTorch on a process per core, the silos dealt as packing
  deals them) measures that work at each N; "round time linear with the work" is read as
  federation / limit staying within 20% of its value at 10 silos;
- memory: the peak, over the run, of the USS (memory no other process shares) summed over this
  run's Ray: the driver and every process it started (GCS, raylet, agents, workers), sampled
  every 0.5 s; and of the silo workers alone. Per additional silo: the growth of the total's
  peak from 10 silos, divided by the silos added (target <= 80 MB at 128).

Times are the minimum of --repeats runs, each started once the shared machine is quiet
(benchmarks/machine.py); memory peaks the median. Other engineers' Ray instances
on the machine are not counted: only processes descended from this script.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from common import RoundClock, run_main, start_local_ray
from limit import run_limit
from machine import load_average, wait_for_quiet
from paths import in_repo

from silo_pfl.data import load_silo_data, silo_names
from silo_pfl.federation import Federation
from silo_pfl.settings import load_config

JOB = in_repo("jobs/digits_label_skew.yaml")
BASE = ["algorithm.name=fedavg", "model.name=mlp", "tracking.enabled=false"]
SAMPLE_S = 0.5
MIB = 1024 * 1024
WORKER_TITLE = "SiloHost"  # ray::SiloHost, ray::SiloHost.fit, ...


def _psutil() -> Any:
    """psutil, which Ray vendors (ray/thirdparty_files, on sys.path once ray is imported)."""
    import psutil

    return psutil


def uss_now() -> tuple[float, float]:
    """(USS of this process and all its descendants, USS of the silo workers among them), MiB."""
    psutil = _psutil()
    me = psutil.Process()
    total = workers = 0
    for proc in [me, *me.children(recursive=True)]:
        try:
            uss = proc.memory_full_info().uss
            title = " ".join(proc.cmdline())
        except psutil.Error:
            continue
        total += uss
        if WORKER_TITLE in title:
            workers += uss
    return total / MIB, workers / MIB


@contextmanager
def peak_uss() -> Iterator[dict[str, float]]:
    """While the block runs, the peak of `uss_now()` sampled every SAMPLE_S seconds."""
    peak = {"total": 0.0, "workers": 0.0}
    stop = threading.Event()

    def sample() -> None:
        while True:
            total, workers = uss_now()
            peak["total"] = max(peak["total"], total)
            peak["workers"] = max(peak["workers"], workers)
            if stop.wait(SAMPLE_S):
                return

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield peak
    finally:
        stop.set()
        thread.join()


def overrides(silos: int) -> list[str]:
    return [*BASE, f"data.num_silos={silos}"]


def sgd_steps(silos: int) -> int:
    """Optimizer steps per round over all silos: each silo's batches times its epochs."""
    cfg = load_config(JOB, overrides(silos))
    train = cfg.train
    rows = [len(load_silo_data(cfg.data, n, cfg.seed).y_train) for n in silo_names(cfg.data)]
    return sum(math.ceil(r / train.batch_size) * train.local_epochs for r in rows)


def rounds_for(silos: int, every: list[int], rounds: int) -> int:
    """The rounds of a run of `silos` silos: `rounds` at the largest of `every`, and as many
    silo-rounds at each smaller N."""
    return max(rounds, math.ceil(rounds * max(every) / silos))


def federation(silos: int, rounds: int) -> dict[str, float]:
    """One run: start-up, steady seconds per round, and the memory peaks."""
    with tempfile.TemporaryDirectory() as tmp, peak_uss() as peak:
        config = load_config(JOB, [*overrides(silos), f"rounds={rounds}", f"output_dir={tmp}"])
        clock = RoundClock()
        Federation(config, callbacks=[clock]).run()
    return {
        "startup": clock.startup_seconds(),
        "round": statistics.median(clock.round_seconds()[1:]),
        **peak,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--silos", nargs="+", type=int, default=[10, 32, 64, 128])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    start_local_ray()
    cores = os.cpu_count() or 1
    idle = uss_now()[0]
    rows: dict[int, dict[str, float]] = {}
    for silos in args.silos:
        rounds = rounds_for(silos, args.silos, args.rounds)
        runs, limits = [], []
        for _ in range(args.repeats):
            wait_for_quiet()
            runs.append(federation(silos, rounds))
            wait_for_quiet()
            seconds, _ = run_limit(JOB, overrides(silos), rounds, cores)
            limits.append(statistics.median(seconds[1:]))
            print(f"  {silos} silos: {runs[-1]} limit {limits[-1]:.3f}", flush=True)
        rows[silos] = {
            "startup": min(r["startup"] for r in runs),
            "round": min(r["round"] for r in runs),
            "limit": min(limits),
            "total": statistics.median(r["total"] for r in runs),
            "workers": statistics.median(r["workers"] for r in runs),
            "steps": sgd_steps(silos),
        }
    print(
        f"\n{JOB} fedavg, mlp, pathological 2 classes per silo, {cores} cores, packed (auto); "
        f"times: minimum of {args.repeats} runs, the median of rounds 2-R, R = {args.rounds} x "
        f"{max(args.silos)} / N; USS: median "
        f"of the runs' peaks, this Ray idle = {idle:.0f} MiB; load average {load_average()}\n"
    )
    print(
        "| silos | start-up s | s / round | SGD steps / round | limit s / round | "
        "federation / limit | relative to 10 silos | peak USS, all (MiB) | of which silo workers "
        "| MiB per silo added |"
    )
    print("|---" * 10 + "|")
    first_n = args.silos[0]
    first = rows[first_n]
    for silos, row in rows.items():
        ratio = row["round"] / row["limit"]
        relative = ratio / (first["round"] / first["limit"])
        added = (
            f"{(row['total'] - first['total']) / (silos - first_n):.1f}" if silos != first_n else ""
        )
        print(
            f"| {silos} | {row['startup']:.2f} | {row['round']:.3f} | {row['steps']:.0f} | "
            f"{row['limit']:.3f} | {ratio:.2f}x | {relative:.2f} | {row['total']:.0f} | "
            f"{row['workers']:.0f} | {added} |"
        )


if __name__ == "__main__":
    run_main(main)
