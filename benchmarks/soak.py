"""Soak: a long run with a silo's process SIGKILLed every few rounds; no leak, no growth.

    python benchmarks/soak.py [JOB] [--rounds 200] [--kill-every 20] [--tracking off|on|both]
                              [key=value ...]

Runs JOB (default jobs/heart_disease.yaml: 4 hospital silos) for --rounds rounds on a local Ray
that the run itself starts and shuts down (train.local_epochs=10, so a fit lasts ~0.1-0.5 s; one
silo per worker process, ray.silos_per_worker=1, so that a kill hits one silo). At
the start of rounds k+1, 2k+1, ... (k = --kill-every) a timer SIGKILLs one silo's process 50 ms
later, mid-fit; the victim cycles over the silos, and a restarted silo's new pid is taken from
`RoundSummary.restarted`. A kill in the fit makes the round retry (every silo must send by
default); a silo whose fit was already done (switzerland's can take ~20 ms) dies in the evaluation
or commit instead: it is left out of that round's commit and rejoins in the next. Checks, each run:

- the run completes every round, every kill restarts a silo (the silos' `restarts` sum to the
  kills) and every killed pid is gone;
- the driver's RSS at the end of the last round is at most 10% above its RSS after round k
  (the last round before the first kill);
- at the end of the last round exactly 4 silo actors + 1 server actor are alive, counted in the
  GCS actor table (`ray.util.state.list_actors` when the state API answers, else the private
  `ray._private.state.actors()`: the local Ray runs without a dashboard) and, as a cross-check,
  as live descendant processes of the driver titled `ray::SiloHost` / `ray::ServerHost`;
- every process descended from the driver during the run (sampled at the start and after every
  round) is gone a few seconds after the run returned, Ray being shut down by then.

With --tracking on (or both) the run logs to a fresh MLflow SQLite store in a temporary directory.
Prints a report per run; exits 1 if any check fails.
"""

from __future__ import annotations

import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from common import job_parser, run_main
from paths import ROOT

from silo_pfl.callbacks import Callback
from silo_pfl.config import FederationConfig
from silo_pfl.errors import one_line
from silo_pfl.federation import Federation
from silo_pfl.messages import SiloInfo, SplitInfo
from silo_pfl.results import FederationResult, RoundSummary

KILL_DELAY_S = 0.05  # after the round starts: the silos are fitting by then
MAX_RSS_GROWTH = 0.10
LEAK_GRACE_S = 5.0  # how long after the run a process it started may take to exit
ACTOR_TITLES = {"SiloHost": "ray::SiloHost", "ServerHost": "ray::ServerHost"}


def _psutil() -> Any:
    """psutil, which Ray vendors (ray/thirdparty_files, on sys.path once ray is imported)."""
    import psutil

    return psutil


def rss_mib() -> float:
    """This process's resident set size (VmRSS), in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def descendants() -> dict[tuple[int, float], str]:
    """Every live descendant of this process: (pid, create time) -> its command line, short."""
    psutil = _psutil()
    found: dict[tuple[int, float], str] = {}
    for proc in psutil.Process().children(recursive=True):
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            found[(proc.pid, proc.create_time())] = " ".join(proc.cmdline())[:90]
        except psutil.Error:
            continue
    return found


def still_alive(pid: int, created: float | None = None) -> bool:
    """Whether `pid` is a live (not zombie) process, the same one if `created` is given."""
    psutil = _psutil()
    try:
        proc = psutil.Process(pid)
        if created is not None and abs(proc.create_time() - created) > 0.01:
            return False
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def count_actors() -> tuple[str, dict[str, int]]:
    """Alive actors per class, from the state API if it answers, else from the GCS actor table."""
    try:
        from ray.util.state import list_actors

        address = ray.get_runtime_context().gcs_address
        rows = list_actors(address=address, filters=[("state", "=", "ALIVE")], timeout=10)
        counts: dict[str, int] = {}
        for row in rows:
            counts[row.class_name] = counts.get(row.class_name, 0) + 1
        return "ray.util.state.list_actors", counts
    except Exception as exc:  # any failure: fall back to the GCS table
        state_api_error = f"{type(exc).__name__}: {one_line(exc)[:120]}"
    from ray._private import state

    counts = {}
    for info in state.actors().values():
        if info.get("State") == "ALIVE":
            name = info.get("ActorClassName", "?")
            counts[name] = counts.get(name, 0) + 1
    return f"ray._private.state.actors() (state API failed: {state_api_error})", counts


def count_actor_processes() -> dict[str, int]:
    """Live descendant processes of the driver titled ray::SiloHost / ray::ServerHost."""
    counts = dict.fromkeys(ACTOR_TITLES, 0)
    for cmdline in descendants().values():
        for name, title in ACTOR_TITLES.items():
            if cmdline.split(" ")[0].split(".")[0] == title:
                counts[name] += 1
    return counts


@dataclass
class Kill:
    """One SIGKILL: when, whom, and whether the signal was delivered."""

    round: int
    silo: str
    pid: int
    delivered: bool = False
    error: str = ""


@dataclass
class SoakWatcher(Callback):
    """Kills a silo every `kill_every` rounds; samples RSS, descendants and the actors."""

    kill_every: int
    silos: list[str] = field(default_factory=list)
    pids: dict[str, int] = field(default_factory=dict)
    kills: list[Kill] = field(default_factory=list)
    rounds: int = 0
    rss: dict[int, float] = field(default_factory=dict)  # round -> driver RSS after it, MiB
    threads: dict[int, int] = field(default_factory=dict)  # round -> driver threads after it
    seen: dict[tuple[int, float], str] = field(default_factory=dict)  # every descendant seen
    actors_method: str = ""
    actors: dict[str, int] = field(default_factory=dict)
    actor_processes: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    timers: list[threading.Timer] = field(default_factory=list)

    def on_start(
        self, config: FederationConfig, silos: Sequence[SiloInfo], split: SplitInfo
    ) -> None:
        self.rounds = config.rounds
        self.silos = [info.silo for info in silos]
        self.pids = {info.silo: info.pid for info in silos}
        self.seen.update(descendants())

    def _kill(self, kill: Kill) -> None:
        try:
            os.kill(kill.pid, signal.SIGKILL)
            kill.delivered = True
        except OSError as exc:
            kill.error = f"{type(exc).__name__}: {exc}"

    def on_round_start(self, round_: int) -> None:
        if round_ <= self.kill_every or (round_ - 1) % self.kill_every:
            return
        silo = self.silos[len(self.kills) % len(self.silos)]
        kill = Kill(round_, silo, self.pids[silo])
        self.kills.append(kill)
        timer = threading.Timer(KILL_DELAY_S, self._kill, args=(kill,))
        timer.start()
        self.timers.append(timer)

    def on_round_end(self, summary: RoundSummary) -> None:
        psutil = _psutil()
        for silo, info in summary.restarted.items():
            old = self.pids[silo]
            if info["pid"] == old:
                self.problems.append(f"round {summary.round}: {silo} rejoined with its old pid")
            elif still_alive(old):
                self.problems.append(f"round {summary.round}: {silo}'s old pid {old} is alive")
            self.pids[silo] = info["pid"]
        self.rss[summary.round] = rss_mib()
        self.threads[summary.round] = psutil.Process().num_threads()
        self.seen.update(descendants())
        if summary.round % self.kill_every == 0 or summary.restarted:
            rejoined = ", ".join(f"{n} (pid {i['pid']})" for n, i in summary.restarted.items())
            print(
                f"  round {summary.round:>4}  {summary.seconds:6.2f} s  attempts "
                f"{summary.attempts}  RSS {self.rss[summary.round]:6.1f} MiB"
                + (f"  restarted {rejoined}" if rejoined else ""),
                flush=True,
            )
        if summary.round == self.rounds:
            self.actors_method, self.actors = count_actors()
            self.actor_processes = count_actor_processes()


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def soak(job: str, overrides: list[str], rounds: int, kill_every: int, tracking: bool) -> bool:
    """One run with its checks; prints the report and returns whether every check passed."""
    watcher = SoakWatcher(kill_every)
    failures: list[str] = []
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        options = [
            "train.local_epochs=10",
            "ray.silos_per_worker=1",
            *overrides,
            f"rounds={rounds}",
            f"output_dir={tmp}/runs",
            f"tracking.enabled={str(tracking).lower()}",
        ]
        if tracking:
            options.append(f"tracking.uri=sqlite:///{tmp}/mlflow.db")
        label = "tracking on (MLflow SQLite)" if tracking else "tracking off"
        print(f"== {job}, {rounds} rounds, a silo killed every {kill_every}, {label}", flush=True)
        began = time.perf_counter()
        result: FederationResult | None = None
        try:
            result = Federation(job, options, [watcher]).run()
        except Exception as exc:  # report it, then look for leaks all the same
            failures.append(f"the run failed: {type(exc).__name__}: {exc}")
        wall = time.perf_counter() - began
        for timer in watcher.timers:
            timer.cancel()
        after_run_rss = rss_mib()
        deadline = time.monotonic() + LEAK_GRACE_S
        leaked = dict(watcher.seen)
        while leaked and time.monotonic() < deadline:
            leaked = {k: v for k, v in leaked.items() if still_alive(k[0], k[1])}
            if leaked:
                time.sleep(0.5)
        leaked = {k: v for k, v in leaked.items() if still_alive(k[0], k[1])}
        leftover = descendants()

    done = len(result.history) if result else len(watcher.rss)
    restarts = sum(s.restarts for s in result.silos.values()) if result else 0
    kills = len(watcher.kills)
    delivered = sum(k.delivered for k in watcher.kills)
    retried = [
        k.round for k in watcher.kills if result and result.history[k.round - 1].attempts > 1
    ]
    fault_rounds = {k.round for k in watcher.kills}
    if result:
        fault_rounds |= {s.round for s in result.history if s.restarted or s.attempts > 1}
    history = result.history if result else []
    normal = [s.seconds for s in history if s.round not in fault_rounds and s.round > 1]
    faulty = [s.seconds for s in history if s.round in fault_rounds]
    base_round = min(kill_every, rounds)
    base, end = watcher.rss.get(base_round, float("nan")), watcher.rss.get(rounds, float("nan"))
    growth = (end - base) / base

    if done != rounds:
        failures.append(f"{done} of {rounds} rounds completed")
    if delivered != kills:
        failures.append("kills not delivered: " + "; ".join(k.error for k in watcher.kills))
    if result and restarts != kills:
        failures.append(f"{restarts} restarts for {kills} kills")
    if not growth <= MAX_RSS_GROWTH:
        failures.append(f"driver RSS grew {growth:.1%} (> {MAX_RSS_GROWTH:.0%})")
    expected = {"SiloHost": len(watcher.silos) or 4, "ServerHost": 1}
    if watcher.actors != expected:
        failures.append(f"alive actors at the end {watcher.actors}, expected {expected}")
    if watcher.actor_processes != expected:
        failures.append(
            f"actor processes at the end {watcher.actor_processes}, expected {expected}"
        )
    if leaked or leftover:
        failures.append(f"{len(leaked)} leaked processes, {len(leftover)} children left")
    failures.extend(watcher.problems)

    print(f"rounds completed     {done}/{rounds}")
    print(
        f"kills                {kills} (delivered {delivered}) in rounds "
        f"{[k.round for k in watcher.kills]}"
    )
    print(
        f"  retried            {len(retried)} of {kills} killed rounds (the kill landed in the fit)"
    )
    for kill in watcher.kills:
        if result and kill.round not in retried:
            summary = result.history[kill.round - 1]
            print(
                f"  not retried        round {kill.round}: {kill.silo} "
                f"{summary.absent.get(kill.silo, 'not absent')!r}, participants "
                f"{summary.participants}; it rejoined in the next round"
            )
    print(f"fault rounds         {sorted(fault_rounds)} (a kill, a retry or a restart)")
    if result:
        per_silo = ", ".join(f"{n} {s.restarts}" for n, s in result.silos.items())
        print(f"restarts             {restarts} ({per_silo})")
        print(f"mean test accuracy   {result.mean_test_accuracy:.4f}")
    print(f"wall time            {wall:.1f} s (the run, from Ray's start to its shutdown)")
    print(
        f"round seconds        mean {_mean(normal):.3f} s (median "
        f"{statistics.median(normal) if normal else float('nan'):.3f}) over {len(normal)} "
        f"rounds without a fault (round 1 left out); mean {_mean(faulty):.3f} s over "
        f"{len(faulty)} fault rounds"
    )
    print(
        f"driver RSS           {base:.1f} MiB after round {base_round}, {end:.1f} MiB after "
        f"round {rounds}: {growth:+.1%} (limit +{MAX_RSS_GROWTH:.0%}); {after_run_rss:.1f} MiB "
        "after the run returned"
    )
    if watcher.rss:
        peak = max(watcher.rss.items(), key=lambda item: item[1])
        print(f"  peak               {peak[1]:.1f} MiB after round {peak[0]}")
    print(
        f"driver threads       {watcher.threads.get(base_round)} after round {base_round}, "
        f"{watcher.threads.get(rounds)} after round {rounds}"
    )
    print(f"alive actors (end)   {watcher.actors} via {watcher.actors_method}")
    print(f"actor processes      {watcher.actor_processes} (ray::<class> descendants)")
    print(f"processes seen       {len(watcher.seen)} descendants of the driver during the run")
    if leaked or leftover:
        for (pid, _), cmdline in {**leaked, **leftover}.items():
            print(f"  LEAKED pid {pid}: {cmdline}")
    else:
        print(f"leaked processes     none ({LEAK_GRACE_S:g} s after the run returned)")
    for failure in failures:
        print(f"FAIL: {failure}")
    print("PASS" if not failures else "FAILED", flush=True)
    return not failures


def main() -> None:
    parser = job_parser(__doc__, "jobs/heart_disease.yaml")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--kill-every", type=int, default=20)
    parser.add_argument("--tracking", choices=("off", "on", "both"), default="both")
    args = parser.parse_args()
    if args.kill_every < 1 or args.rounds < args.kill_every:
        parser.error("need --kill-every >= 1 and --rounds >= --kill-every")
    os.chdir(ROOT)
    os.environ.pop("RAY_ADDRESS", None)  # a fresh local Ray, started by the run
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.tracking]
    passed = [soak(args.job, args.overrides, args.rounds, args.kill_every, t) for t in modes]
    sys.exit(0 if all(passed) else 1)


if __name__ == "__main__":
    run_main(main)
