"""`silo-pfl compare`: every algorithm of a spec on every job of it, in parallel, cached.

A spec (jobs/compare/all.yaml by default) names the jobs (a job YAML, seeds, overrides), the
algorithms (rows: a registered algorithm, overrides, candidate overrides) and the baseline row
each silo's gain is measured against. For every row on every job:

1. each candidate runs on the job's first seed; the one with the best mean validation accuracy
   over silos wins (`choose_candidate`; test accuracy never chooses);
2. the winner runs on every seed.

Each run is `silo-pfl run JOB key=value ... tracking.enabled=false` on a local Ray, in one of
`workers` processes (each keeps its own local Ray for all its runs). Its results JSON is cached
under `cache/<key>.json`, the key being a hash of the resolved config minus what cannot change
results (`cache_key`), so a second comparison computes only what changed. The tables and the
JSON are made by `silo_pfl.compare_table`. Nothing heavy is imported until a comparison runs.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import math
import multiprocessing
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from silo_pfl.compare_runs import (
    Cache,
    Record,
    Run,
    execute,
    execute_marked,
    init_worker,
    make_run,
)
from silo_pfl.compare_spec import JobSpec, RowSpec, Spec, load_spec, parse_spec
from silo_pfl.errors import ConfigError, typed_line
from silo_pfl.stop_signals import sigterm_interrupts

__all__ = ["choose_candidate", "compare", "load_spec", "mean_val_accuracy", "parse_spec"]

DEFAULT_SPEC = "jobs/compare/all.yaml"
DEFAULT_CACHE = ".compare_cache"
DEFAULT_OUT = "docs/RESULTS.md"
DEFAULT_JSON = "docs/results/compare.json"


def default_workers() -> int:
    """Two concurrent federations at most: each has an actor per silo (10 silos: 4-5 GB)."""
    return max(1, min(2, os.cpu_count() or 1))


@dataclass
class Unit:
    """One row on one job: its candidates on the first seed, then the winner on every seed."""

    job: JobSpec
    row: RowSpec
    first: list[Run]  # one per candidate, on the job's first seed
    chosen: int | None = None  # index into first; None until chosen (or if none can be)
    decided: bool = False
    error: str | None = None  # why no candidate was chosen when some ran (no validation figure)
    seeds: list[Run] = field(default_factory=list)  # the winner's runs, one per seed

    @property
    def candidates(self) -> tuple[tuple[str, ...], ...]:
        return tuple(run.candidate for run in self.first)


def plan(spec: Spec) -> tuple[list[Unit], dict[str, dict[str, str]]]:
    """Every (job, row) unit with its first-seed runs, all configs checked; and per job the
    rows that do not run there, with why."""
    units: list[Unit] = []
    skipped: dict[str, dict[str, str]] = {}
    for job in spec.jobs.values():
        for row in spec.rows.values():
            if not row.runs_on(job.label):
                only = ", ".join(row.only_jobs or ())
                skipped.setdefault(job.label, {})[row.label] = f"only_jobs: {only}"
                continue
            first = [make_run(job, row, c, job.seeds[0]) for c in row.candidates_for(job.label)]
            units.append(Unit(job, row, first))
    return units, skipped


def mean_val_accuracy(result: dict[str, Any]) -> float | None:
    """The mean, over the silos that have one, of each silo's selected model's validation
    accuracy; None if no silo has one. A silo without validation rows has NaN (null once
    written as JSON, e.g. in the cache): it is left out, in memory and from the cache alike."""
    values = [
        float(v)
        for silo in result["silos"].values()
        if isinstance(v := silo.get("val_accuracy"), (int, float)) and math.isfinite(v)
    ]
    return sum(values) / len(values) if values else None


BROKEN_TWICE = "its worker process died (BrokenProcessPool), twice"
NO_VALIDATION = (
    "no validation figure to choose a candidate by (no silo has validation rows): "
    "set data.val_fraction > 0, or list one candidate"
)


def choose_candidate(results: Sequence[dict[str, Any] | None]) -> int | None:
    """The index of the result with the best mean validation accuracy over silos (the first of
    equals); None if none can be chosen. Failed runs (None) never win, nor does a run without a
    validation figure (`mean_val_accuracy` None) over one with a figure. A lone run that
    succeeded is chosen whatever its figure; several without any figure give None (a choice
    would be blind: see `NO_VALIDATION`). Test accuracy is not read."""
    ran = [index for index, result in enumerate(results) if result is not None]
    scored = [(mean_val_accuracy(results[i]), i) for i in ran]  # type: ignore[arg-type]
    best: tuple[float, int] | None = None
    for value, index in scored:
        if value is not None and (best is None or value > best[0]):
            best = (value, index)
    if best is not None:
        return best[1]
    return ran[0] if len(ran) == 1 else None


def known_total(units: Sequence[Unit], todo: int) -> int | None:
    """The number of runs to compute, when known before any runs: no undecided unit may queue
    its winner on further seeds. Otherwise None (the progress shows no denominator)."""
    if all(unit.decided or len(unit.job.seeds) == 1 for unit in units):
        return todo
    return None


def progress_label(done: int, total: int | None) -> str:
    """`[3/8]` with a total known up front, else `[3]`."""
    return f"[{done}]" if total is None else f"[{done}/{total}]"


def _format_val(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


@dataclass
class Outcome:
    """A comparison's units with every run's record, and what it cost."""

    spec: Spec
    units: list[Unit]
    records: dict[str, Record]
    skipped: dict[str, dict[str, str]]
    computed: int
    cached: int
    wall_seconds: float
    workers: int

    @property
    def unchosen(self) -> list[str]:
        """The rows whose runs finished but could not choose a candidate, and why."""
        return [f"{u.job.label} {u.row.label}: {u.error}" for u in self.units if u.error]

    @property
    def failed_runs(self) -> list[str]:
        """The runs that failed, and why (each once)."""
        runs = {r.key: r for u in self.units for r in [*u.first, *u.seeds]}
        return [
            f"{run.describe()}: {record.error}"
            for key, run in runs.items()
            if (record := self.records.get(key)) is not None and record.error
        ]

    @property
    def failures(self) -> list[str]:
        """What the tables show as failed: rows that chose nothing, then runs that failed."""
        return [*self.unchosen, *self.failed_runs]

    def failure_line(self) -> str | None:
        """One line counting the failed runs and the rows that chose nothing, apart; None if
        there are neither."""
        runs, rows = self.failed_runs, self.unchosen
        counts = [f"{len(runs)} run{'s' if len(runs) != 1 else ''} failed"] if runs else []
        if rows:
            counts.append(f"{len(rows)} row{'s' if len(rows) != 1 else ''} chose no candidate")
        if not counts:
            return None
        return f"error: {' and '.join(counts)} (shown in the tables): {'; '.join(self.failures)}"


def _stop_workers(pool: cf.ProcessPoolExecutor, grace: float = 120.0) -> None:
    """Cancel what has not started, SIGTERM every worker (its run stops, its Ray shuts down),
    SIGKILL one still alive after `grace` seconds."""
    processes = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + grace
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()


def git_commit() -> str:
    """The commit (short) of the checkout silo_pfl is imported from, whatever the working
    directory, '+dirty' with uncommitted changes; '' when silo_pfl is not in a git checkout
    (installed in a virtual environment inside another project's, say: git would answer for it,
    but tracks no file of silo_pfl's)."""
    here = Path(__file__).resolve()
    git = ["git", "-C", str(here.parent)]
    try:
        tracked = subprocess.run(
            [*git, "ls-files", "--error-unmatch", here.name], capture_output=True, timeout=10
        )
        if tracked.returncode != 0:
            return ""
        commit = subprocess.run(
            [*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            [*git, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
    return f"{commit}+dirty" if commit and dirty else commit


def compare(
    spec: Spec,
    workers: int | None = None,
    cache: str | Path = DEFAULT_CACHE,
    log: Callable[[str], None] = print,
    dry_run: bool = False,
) -> Outcome:
    """Run the comparison: each unit's candidates on its first seed, the winner on every seed.

    Cached runs are read, never run; the others run in `workers` pool processes (started only if
    something must run). A run that fails is reported in its unit and not cached. With
    `dry_run`, nothing runs: the log says what would."""
    workers = default_workers() if workers is None else workers
    if workers < 1:
        raise ConfigError(f"--workers: got {workers}, expected an integer >= 1")
    start = time.perf_counter()
    store = Cache(cache)
    units, skipped = plan(spec)
    records: dict[str, Record] = {}
    waiting: dict[cf.Future[dict[str, Any]], Run] = {}
    queued: set[str] = set()
    backlog: list[Run] = []  # to submit
    suspects: list[Run] = []  # had started in a pool that broke: run again, alone
    broke: set[str] = set()  # the runs that were suspects
    pool: cf.ProcessPoolExecutor | None = None
    pool_size = 0
    started = ""  # the directory where the pool's workers mark the runs they start
    commit = git_commit()
    counts = {"computed": 0, "cached": 0, "todo": 0}
    total: int | None = None

    def ensure(runs: Iterable[Run]) -> None:
        for run in runs:
            if run.key in records or run.key in queued:
                continue
            hit = store.get(run.key) if run.cacheable else None
            if hit is not None:
                records[run.key] = hit
                counts["cached"] += 1
                continue
            queued.add(run.key)
            counts["todo"] += 1
            if dry_run:
                log(f"would run: {run.describe()}: {run.command}")
                continue
            backlog.append(run)

    def drop_pool() -> None:
        nonlocal pool
        if pool is not None:
            _stop_workers(pool)
            pool = None
        shutil.rmtree(started, ignore_errors=True)

    def submit(runs: Sequence[Run], size: int) -> list[Run]:
        """Submit `runs` to a pool of `size` workers (a new one if the current is not so).
        Returns those not submitted: the pool broke under them (a worker died between two
        waits), and the next wait collects what it held. With nothing under way, a fresh pool
        is tried once more."""
        nonlocal pool, pool_size, started
        left = list(runs)
        for _ in range(2):
            if pool is not None and pool_size != size:
                drop_pool()
            if pool is None:
                pool = cf.ProcessPoolExecutor(
                    max_workers=size,
                    mp_context=multiprocessing.get_context("spawn"),
                    initializer=init_worker,
                    initargs=(max(1, (os.cpu_count() or 1) // workers),),
                )
                pool_size = size
                started = tempfile.mkdtemp(prefix="silo_pfl_compare_started_")
            try:
                while left:
                    args = (started, left[0].key, execute, left[0].config, list(left[0].overrides))
                    waiting[pool.submit(execute_marked, *args)] = left[0]
                    left.pop(0)
            except BrokenProcessPool:
                if waiting:
                    return left
                drop_pool()
            else:
                return []
        raise BrokenProcessPool("a fresh pool of compare workers broke before any run started")

    def dispatch() -> None:
        """Submit what waits: a suspect alone in a pool of one worker (so that a second break
        is its own), else the backlog to a pool of `workers`."""
        if suspects:
            if not waiting and not submit(suspects[:1], 1):
                suspects.pop(0)
        elif backlog and (not waiting or pool_size == workers):
            backlog[:] = submit(backlog, workers)

    def finish(run: Run, answer: dict[str, Any]) -> None:
        queued.discard(run.key)
        counts["computed"] += 1
        if "error" in answer:
            records[run.key] = Record(None, answer["error"], commit=commit)
            done_of = progress_label(counts["computed"], total)
            log(f"{done_of} {run.describe()}: FAILED: {answer['error']}")
            return
        record = Record(answer["result"], None, False, answer["elapsed_seconds"], commit)
        records[run.key] = record
        if run.cacheable:
            store.put(run, record)
        result = answer["result"]
        log(
            f"{progress_label(counts['computed'], total)} {run.describe()}: test "
            f"{result['mean_test_accuracy']:.4f} "
            f"val {_format_val(mean_val_accuracy(result))} "
            f"({result['wall_seconds']:.1f} s)"
        )

    def broken(runs: list[Run]) -> None:
        """The pool broke (a worker process died, e.g. out of memory): every run it held failed
        with it. Those that never started go back to the backlog; those that had started run
        again, each alone; one that breaks its pool a second time failed."""
        marked = {run.key for run in runs if os.path.exists(os.path.join(started, run.key))}
        drop_pool()
        ran = [run for run in runs if run.key in marked] or runs  # died before any started
        for run in runs:
            if run not in ran:
                backlog.append(run)
            elif run.key in broke:
                finish(run, {"error": BROKEN_TWICE})
            else:
                broke.add(run.key)
                suspects.append(run)
        again = [run.describe() for run in ran if run.key not in records]
        if again:
            log(f"a worker process died (BrokenProcessPool): running again {', '.join(again)}")

    def advance() -> None:
        """Decide every unit whose candidates are all done, and every unit of one candidate at
        once (there is nothing to choose); queue its winner's seeds."""
        progress = True
        while progress:
            progress = False
            for unit in units:
                if unit.decided:
                    continue
                if len(unit.first) == 1:
                    unit.chosen = 0
                elif all(r.key in records for r in unit.first):
                    unit.chosen = choose_candidate([records[r.key].result for r in unit.first])
                else:
                    continue
                unit.decided = progress = True
                if unit.chosen is None:
                    if any(records[r.key].result is not None for r in unit.first):
                        unit.error = NO_VALIDATION
                        log(f"{unit.job.label} {unit.row.label}: {NO_VALIDATION}")
                    continue
                candidate = unit.first[unit.chosen].candidate
                unit.seeds = [unit.first[unit.chosen]] + [
                    make_run(unit.job, unit.row, candidate, seed) for seed in unit.job.seeds[1:]
                ]
                ensure(unit.seeds)

    stack = contextlib.ExitStack()
    try:
        stack.enter_context(sigterm_interrupts())
        for unit in units:
            ensure(unit.first)
        advance()
        total = known_total(units, counts["todo"])
        dispatch()
        while waiting:
            done, _ = cf.wait(waiting, return_when=cf.FIRST_COMPLETED)
            if any(isinstance(f.exception(), BrokenProcessPool) for f in done):
                done, _ = cf.wait(waiting)  # a broken pool fails all its futures
            lost: list[Run] = []
            for future in done:
                run = waiting.pop(future)
                try:
                    answer = future.result()
                except BrokenProcessPool:
                    lost.append(run)
                    continue
                except Exception as exc:
                    answer = {"error": typed_line(exc)}
                finish(run, answer)
            if lost:
                broken(lost)
            advance()
            dispatch()
    finally:
        try:
            if pool is not None and waiting:  # interrupted (or failed): stop the runs under way
                _stop_workers(pool)
            elif pool is not None:
                pool.shutdown()
        finally:
            if started:
                shutil.rmtree(started, ignore_errors=True)
            stack.close()
    if dry_run:
        undecided = sum(1 for u in units if not u.decided)
        rest = sum(len(u.job.seeds) - 1 for u in units if not u.decided)
        log(
            f"{counts['todo']} runs to compute, {counts['cached']} from the cache"
            + (f"; then up to {rest} more once {undecided} choices are made" if rest else "")
        )
    return Outcome(
        spec,
        units,
        records,
        skipped,
        counts["computed"],
        counts["cached"],
        time.perf_counter() - start,
        workers,
    )


# ------------------------------------------------------------------------------------------ CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`silo-pfl compare`'s options (kept here so that cli.py holds one entry)."""
    parser.add_argument(
        "spec",
        nargs="?",
        default=DEFAULT_SPEC,
        help=f"comparison spec YAML (default {DEFAULT_SPEC})",
    )
    parser.add_argument("--jobs", nargs="+", metavar="JOB", help="only these jobs of the spec")
    parser.add_argument(
        "--algorithms", nargs="+", metavar="ALGORITHM", help="only these algorithms of the spec"
    )
    parser.add_argument(
        "--max-seeds",
        type=int,
        metavar="N",
        help="only each job's first N seeds (a quicker comparison; the hyper-parameters are "
        "chosen on the first seed as always)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=default_workers(),
        help="federations run at once, each in its own process and local Ray (default "
        "min(2, cores); a 10-silo federation takes 4-5 GB)",
    )
    parser.add_argument(
        "--cache", default=DEFAULT_CACHE, help=f"results of past runs (default {DEFAULT_CACHE})"
    )
    parser.add_argument(
        "--out",
        default=DEFAULT_OUT,
        help=f"markdown file whose compare region gets the tables (default {DEFAULT_OUT})",
    )
    parser.add_argument(
        "--json", default=DEFAULT_JSON, help=f"every figure as JSON (default {DEFAULT_JSON})"
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="say what would run and what is cached; run nothing"
    )


def command_line(args: argparse.Namespace) -> str:
    """The command that reproduces this comparison (default options left out)."""
    parts = ["silo-pfl", "compare", args.spec]
    if args.jobs:
        parts += ["--jobs", *args.jobs]
    if args.algorithms:
        parts += ["--algorithms", *args.algorithms]
    if args.max_seeds is not None:
        parts += ["--max-seeds", str(args.max_seeds)]
    for option, default in (
        ("workers", default_workers()),
        ("cache", DEFAULT_CACHE),
        ("out", DEFAULT_OUT),
        ("json", DEFAULT_JSON),
    ):
        if getattr(args, option) != default:
            parts += [f"--{option}", str(getattr(args, option))]
    return shlex.join(parts)


def main(args: argparse.Namespace) -> int:
    """`silo-pfl compare`: run (or read from the cache) every run, then write the tables."""
    from silo_pfl import compare_table

    if args.spec == DEFAULT_SPEC and not Path(DEFAULT_SPEC).is_file():
        raise ConfigError(
            f"spec: no {DEFAULT_SPEC} in {Path.cwd()}; the default spec and outputs are the "
            "repository's, relative to the working directory: run silo-pfl compare from the "
            "repository's root, or name a spec"
        )
    spec = load_spec(args.spec).select(args.jobs, args.algorithms, args.max_seeds)
    if not args.dry_run:
        compare_table.check_outputs(args.out, args.json)
    outcome = compare(spec, args.workers, args.cache, dry_run=args.dry_run)
    if args.dry_run:
        return 0
    report = compare_table.report(outcome, command_line(args), args.cache, args.json)
    compare_table.write(report, args.out, args.json)
    print(
        f"{outcome.computed} runs computed, {outcome.cached} from the cache {args.cache}, in "
        f"{outcome.wall_seconds:.0f} s; tables in {args.out}, figures in {args.json}"
    )
    failed = outcome.failure_line()
    if failed:
        print(failed, file=sys.stderr)
        return 1
    return 0
