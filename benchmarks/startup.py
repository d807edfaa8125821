"""Where the seconds of a short run go, at 4, 10 and 32 silos; and the CLI end to end.

    python benchmarks/startup.py [--silos 4 10 32] [--repeats 3] [--no-cli]

Each measured run is a fresh Python process, as a user's run is. For each silo count it runs
`jobs/digits_label_skew.yaml algorithm.name=fedavg tracking.enabled=false rounds=1
data.num_silos=N` (default packing; at 4 silos, 3 classes each so that every digit is held)
from Python: it starts a local Ray itself (`ray.init`, the reference), imports silo_pfl and
loads the config, runs `Federation(config).run()` (which uses the initialised Ray and leaves it
up), reads Ray's task events, then stops Ray as a run does (`session.shutdown_local`). The
workers' part is cut at milestones of the task events, each the moment the LAST worker (or
task) of its kind reached it, so the columns follow the critical path and add up to the total:

- worker start: from the run's start to the last SiloHost/ServerHost creation task RUNNING (a
  worker process leased to it; Ray prestarts one per CPU, more are spawned);
- worker imports: from there to the last `__init__` task beginning. A worker loads the actor's
  class, which imports silo_pfl and torch, BEFORE its `__init__` task begins; the `__init__`
  span itself is the next column (deserialising the config, building the Silo objects);
- setup (data loading), build (model) and round 1's fits: to the last such task's end;
- the rest: aggregation, evaluation, commits, checkpoints, outcome and stopping the actors, to
  `Federation.run()`'s return; then Ray's shutdown.

Task events come from the GCS (`ray._private.state`, the source `ray.timeline()` reads, with the
task state transitions it leaves out), reported every 100 ms (`task_events_report_interval_ms`)
so that they reach the GCS before the run kills its actors.

Then the CLI as a user runs it, in a fresh process: `python -m silo_pfl run
jobs/digits_label_skew.yaml algorithm.name=fedavg tracking.enabled=false rounds=R --quiet
output_dir=<tmp>` with R = 1 and 31 (the issue's "31-round run"), beside a fresh process that
only imports Ray, starts it and shuts it down. Every figure is the minimum of --repeats runs,
column by column (so a row's columns add up to a little less than its total), each run started
once the shared machine is quiet (benchmarks/machine.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

from machine import load_average, wait_for_quiet
from paths import ROOT, in_repo

JOB = in_repo("jobs/digits_label_skew.yaml")
OVERRIDES = ["algorithm.name=fedavg", "tracking.enabled=false"]
RUNNING, FINISHED = 8, 11  # ray.core.generated.common_pb2.TaskStatus
HOSTS = ("SiloHost", "ServerHost")
COLUMNS = (
    ("ray_init", "`ray.init` (ref)"),
    ("imports", "driver imports + config"),
    ("worker_start", "worker start"),
    ("worker_imports", "worker imports"),
    ("init", "`__init__`"),
    ("setup", "setup (data)"),
    ("build", "build (model)"),
    ("fit", "round 1 fits"),
    ("rest", "rest of round 1 + end"),
    ("shutdown", "`ray.shutdown`"),
    ("total", "total"),
)
EVENT_WAIT_S = 1.5  # after the run: the workers' last task events reach the GCS


def task_spans(since: float) -> list[dict[str, Any]]:
    """Every task of this Ray instance: its name, its state times and its execution span (s,
    relative to `since`)."""
    from ray._private.state import state

    tasks: dict[str, dict[str, Any]] = {}
    for event in state._get_all_task_events():
        task = tasks.setdefault(event.task_id.hex(), {"states": {}, "spans": []})
        if event.HasField("task_info"):
            task["name"] = event.task_info.name
        if event.HasField("state_updates"):
            for status, ns in event.state_updates.state_ts_ns.items():
                task["states"][int(status)] = ns / 1e9 - since
        if event.HasField("profile_events"):
            task["spans"] += [
                (e.event_name, e.start_time / 1e9 - since, e.end_time / 1e9 - since)
                for e in event.profile_events.events
                if e.event_name.startswith("task::")
            ]
    return list(tasks.values())


def _execution(task: dict[str, Any]) -> tuple[float, float]:
    """(start, end) of a task's `task::<Class>.<method>` span."""
    spans = task["spans"]
    if spans:
        return spans[0][1], spans[0][2]
    states = task["states"]  # a worker killed at the run's end may not have sent its spans yet
    if RUNNING in states and FINISHED in states:
        return states[RUNNING], states[FINISHED]
    raise RuntimeError(f"no execution span for task {task.get('name')}: events lost")


def milestones(tasks: list[dict[str, Any]], run_start: float, run_end: float) -> dict[str, float]:
    """The phases of the run (s), cut where the last worker or task of each kind got there."""

    def named(*methods: str) -> list[dict[str, Any]]:
        wanted = {f"{host}.{m}" for host in HOSTS for m in methods} | set(methods)  # call_many
        # names its tasks by the method ("fit_many"), without the class
        return [t for t in tasks if t.get("name") in wanted]

    inits = named("__init__")
    if len(inits) < 2:
        raise RuntimeError(f"task events of {len(inits)} actor(s) only: events lost")
    marks = [
        ("worker_start", max(t["states"][RUNNING] for t in inits)),
        ("worker_imports", max(_execution(t)[0] for t in inits)),
        ("init", max(_execution(t)[1] for t in inits)),
        ("setup", max(_execution(t)[1] for t in named("setup"))),
        ("build", max(_execution(t)[1] for t in named("build"))),
        ("fit", max(_execution(t)[1] for t in named("fit", "fit_many"))),
        ("rest", run_end),
    ]
    phases, previous = {}, run_start
    for key, moment in marks:  # a phase hidden behind the one before it (the server's start
        moment = max(moment, previous)  # outlasting the silos' data loading) takes 0 s
        phases[key], previous = moment - previous, moment
    return phases


def classes_per_silo(silos: int) -> int:
    """The job's 2 digit classes per silo, or as many as it takes for every digit to be held."""
    return max(2, math.ceil(10 / silos))


def child(silos: int) -> dict[str, float]:
    """One measured run in this (fresh) process: its phases in seconds."""
    began = time.time()
    import ray

    imported_ray = time.time()
    ray.init(
        address="local",
        include_dashboard=False,
        log_to_driver=False,
        logging_level=logging.WARNING,
        _system_config={"task_events_report_interval_ms": 100},
    )
    started = time.time()
    from silo_pfl.federation import Federation
    from silo_pfl.runtime.session import shutdown_local

    with tempfile.TemporaryDirectory() as tmp:
        data = [f"data.num_silos={silos}", f"data.classes_per_silo={classes_per_silo(silos)}"]
        federation = Federation(JOB, [*OVERRIDES, "rounds=1", *data, f"output_dir={tmp}"])
        run_start = time.time()
        federation.run()
        run_end = time.time()
    time.sleep(EVENT_WAIT_S)
    phases = milestones(task_spans(began), run_start - began, run_end - began)
    stopping = time.time()
    shutdown_local()
    ended = time.time()
    return {
        "ray_init": started - imported_ray,
        "imports": (imported_ray - began) + (run_start - started),
        **phases,
        "shutdown": ended - stopping,
        "total": ended - began - (stopping - run_end),  # the wait for the events left out
    }


def timed(command: list[str]) -> float:
    """Wall seconds of `command` run from the repository root once the machine is quiet; fails
    loudly if it fails."""
    wait_for_quiet()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    began = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - began
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
    return seconds


def measured_run(silos: int) -> dict[str, float]:
    """One run of `child` in a fresh process, once the machine is quiet."""
    wait_for_quiet()
    command = [sys.executable, __file__, "--child", str(silos)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"startup child with {silos} silos failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


RAY_ALONE = (
    "import logging, ray; ray.init(address='local', include_dashboard=False, "
    "log_to_driver=False, logging_level=logging.WARNING); ray.shutdown()"
)


def cli_rows(repeats: int) -> list[tuple[str, float, float]]:
    """(label, the CLI's seconds, a fresh process's ray.init + shutdown), minima of `repeats`."""
    rows = []
    reference = min(timed([sys.executable, "-c", RAY_ALONE]) for _ in range(repeats))
    for rounds, target in ((1, 8), (31, 11)):
        times = []
        for _ in range(repeats):
            with tempfile.TemporaryDirectory() as tmp:
                command = [sys.executable, "-m", "silo_pfl", "run", JOB, *OVERRIDES]
                times.append(timed([*command, f"rounds={rounds}", "--quiet", f"output_dir={tmp}"]))
            print(f"  CLI rounds={rounds}: {times[-1]:.2f} s", file=sys.stderr, flush=True)
        label = f"CLI, 10 silos, rounds={rounds} (target <= {target} s)"
        rows.append((label, min(times), reference))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--silos", nargs="+", type=int, default=[4, 10, 32])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-cli", action="store_true", help="skip the CLI rows")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child)))
        return
    best: dict[int, dict[str, float]] = {}
    for silos in args.silos:
        for _ in range(args.repeats):
            run = measured_run(silos)
            print(f"  {silos} silos: total {run['total']:.2f} s", file=sys.stderr, flush=True)
            best[silos] = {k: min(v, best.get(silos, run)[k]) for k, v in run.items()}
    cli = [] if args.no_cli else cli_rows(args.repeats)
    print(f"\nseconds, minimum of {args.repeats} runs per column; load average {load_average()}\n")
    print("| run | " + " | ".join(title for _, title in COLUMNS) + " | total / ref |")
    print("|---" * (len(COLUMNS) + 2) + "|")
    for silos, row in best.items():
        cells = " | ".join(f"{row[key]:.2f}" for key, _ in COLUMNS)
        print(f"| {silos} silos, Python API | {cells} | {row['total'] / row['ray_init']:.1f}x |")
    blanks = " | ".join("" for _ in COLUMNS[1:-1])
    for label, seconds, reference in cli:
        ratio = seconds / reference
        print(f"| {label} | {reference:.2f} | {blanks} | {seconds:.2f} | {ratio:.1f}x |")
    if cli:
        print("\nCLI rows: the reference is a fresh process that starts Ray and shuts it down.")


if __name__ == "__main__":
    main()
