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
import hashlib
import json
import multiprocessing
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from silo_pfl.errors import ConfigError, one_line

DEFAULT_SPEC = "jobs/compare/all.yaml"
DEFAULT_CACHE = ".compare_cache"
DEFAULT_OUT = "docs/RESULTS.md"
DEFAULT_JSON = "docs/results/compare.json"
CACHE_VERSION = 1
# Config keys that cannot change a run's results: where it writes, MLflow, which Ray, where
# actors are placed, how long a wait may last. Everything else is in the cache key.
IGNORED_KEYS = (
    "output_dir",
    "tracking",
    "ray",
    "silos",
    "server.node_label",
    "round.timeout_s",
    "round.call_timeout_s",
)
# Set by the comparison itself, so not allowed in a spec's overrides.
RESERVED_KEYS = ("seed", "algorithm.name", "output_dir", "tracking.", "ray.")
FORCED = ("tracking.enabled=false",)

_SPEC_KEYS = ("baseline", "jobs", "algorithms")
_JOB_KEYS = ("config", "seeds", "overrides", "published")
_ROW_KEYS = ("algorithm", "overrides", "candidates", "candidates_by_job", "only_jobs", "note")
_PUBLISHED_KEYS = ("source", "note", "figures")


def default_workers() -> int:
    """Two concurrent federations at most: each has an actor per silo (10 silos: 4-5 GB)."""
    return max(1, min(2, os.cpu_count() or 1))


# ----------------------------------------------------------------------------------------- spec
@dataclass(frozen=True)
class JobSpec:
    """One job of the comparison: a job YAML, its seeds and overrides for every run on it."""

    label: str
    config: str
    seeds: tuple[int, ...]
    overrides: tuple[str, ...] = ()
    published: dict[str, Any] | None = None


@dataclass(frozen=True)
class RowSpec:
    """One row of the tables: an algorithm with its overrides and candidate overrides."""

    label: str
    algorithm: str
    overrides: tuple[str, ...] = ()
    candidates: tuple[tuple[str, ...], ...] = ((),)
    candidates_by_job: dict[str, tuple[tuple[str, ...], ...]] = field(default_factory=dict)
    only_jobs: tuple[str, ...] | None = None
    note: str = ""

    def candidates_for(self, job: str) -> tuple[tuple[str, ...], ...]:
        return self.candidates_by_job.get(job, self.candidates)

    def runs_on(self, job: str) -> bool:
        return self.only_jobs is None or job in self.only_jobs


@dataclass(frozen=True)
class Spec:
    """A comparison: jobs x rows, and the row each silo's gain is measured against."""

    path: str
    jobs: dict[str, JobSpec]
    rows: dict[str, RowSpec]
    baseline: str | None = "local"

    def select(self, jobs: Sequence[str] | None, rows: Sequence[str] | None) -> Spec:
        """The same spec restricted to these jobs and rows (None: all); unknown names fail."""
        return Spec(
            self.path,
            {j: self.jobs[j] for j in _known(jobs, self.jobs, "--jobs")},
            {r: self.rows[r] for r in _known(rows, self.rows, "--algorithms")},
            self.baseline,
        )


def _known(names: Sequence[str] | None, known: dict[str, Any], option: str) -> list[str]:
    if names is None:
        return list(known)
    for name in names:
        if name not in known:
            raise ConfigError(f"{option}: got {name!r}, expected some of {', '.join(known)}")
    return list(dict.fromkeys(names))


def load_spec(path: str | Path) -> Spec:
    """Read and check a comparison spec; every error is one line naming the key."""
    from omegaconf import OmegaConf

    from silo_pfl.config import read_yaml

    raw = OmegaConf.to_container(read_yaml(Path(path)), resolve=True)
    return parse_spec(raw, str(path))


def parse_spec(raw: Any, where: str = "spec") -> Spec:
    """A spec from its mapping (what the YAML holds); see jobs/compare/all.yaml."""

    def fail(key: str, reason: str) -> ConfigError:
        return ConfigError(f"{where}: {key}: {reason}" if key else f"{where}: {reason}")

    def mapping(value: Any, key: str, allowed: Sequence[str] | None = None) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise fail(key, f"expected a mapping, got {_kind(value)}")
        for name in value:
            if not isinstance(name, str):
                raise fail(key, f"keys must be strings, got {name!r}")
            if allowed is not None and name not in allowed:
                raise fail(
                    f"{key}.{name}" if key else name, f"unknown key; allowed: {', '.join(allowed)}"
                )
        return value

    def overrides(value: Any, key: str) -> tuple[str, ...]:
        if value is None:
            return ()
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise fail(key, "expected a list of key=value strings, e.g. [server.lr=0.03]")
        for item in value:
            name, eq, _ = item.partition("=")
            if not eq or not name:
                raise fail(key, f"{item!r} is not key=value, e.g. server.lr=0.03")
            if any(name == r or (r.endswith(".") and name.startswith(r)) for r in RESERVED_KEYS):
                raise fail(key, f"{item!r}: {name} is set by the comparison itself")
        return tuple(value)

    def candidates(value: Any, key: str) -> tuple[tuple[str, ...], ...]:
        if not isinstance(value, list) or not value:
            raise fail(key, "expected a non-empty list of override lists, e.g. [[], [x=1]]")
        found = tuple(
            overrides(v if v is not None else [], f"{key}[{i}]") for i, v in enumerate(value)
        )
        if len(set(found)) != len(found):
            raise fail(key, "the same candidate appears twice")
        return found

    top = mapping(raw, "", _SPEC_KEYS)
    for required in ("jobs", "algorithms"):
        if required not in top:
            raise fail(required, "required key is missing")
    jobs: dict[str, JobSpec] = {}
    for label, value in mapping(top["jobs"], "jobs").items():
        key = f"jobs.{label}"
        entry = mapping(value, key, _JOB_KEYS)
        config = entry.get("config")
        if not isinstance(config, str) or not config:
            raise fail(f"{key}.config", "required: the job YAML, e.g. jobs/heart_disease.yaml")
        seeds = entry.get("seeds", [0])
        if (
            not isinstance(seeds, list)
            or not seeds
            or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in seeds)
            or len(set(seeds)) != len(seeds)
        ):
            raise fail(
                f"{key}.seeds", f"expected distinct integers >= 0, e.g. [0, 1, 2]; got {seeds!r}"
            )
        published = entry.get("published")
        if published is not None:
            published = mapping(published, f"{key}.published", _PUBLISHED_KEYS)
            figures = mapping(published.get("figures", {}), f"{key}.published.figures")
            for name, figure in figures.items():
                if not isinstance(figure, (int, float)) or isinstance(figure, bool):
                    raise fail(
                        f"{key}.published.figures.{name}", f"expected a number, got {figure!r}"
                    )
        jobs[label] = JobSpec(
            label,
            config,
            tuple(seeds),
            overrides(entry.get("overrides"), f"{key}.overrides"),
            published,
        )
    if not jobs:
        raise fail("jobs", "expected at least one job")
    rows: dict[str, RowSpec] = {}
    for label, value in mapping(top["algorithms"], "algorithms").items():
        key = f"algorithms.{label}"
        entry = mapping(value if value is not None else {}, key, _ROW_KEYS)
        algorithm = entry.get("algorithm", label)
        if not isinstance(algorithm, str) or not algorithm:
            raise fail(f"{key}.algorithm", f"expected an algorithm's name, got {algorithm!r}")
        by_job = {
            job: candidates(v, f"{key}.candidates_by_job.{job}")
            for job, v in mapping(
                entry.get("candidates_by_job", {}), f"{key}.candidates_by_job"
            ).items()
        }
        only = entry.get("only_jobs")
        if only is not None and (
            not isinstance(only, list) or not all(isinstance(j, str) for j in only)
        ):
            raise fail(f"{key}.only_jobs", "expected a list of job labels")
        for job in [*by_job, *(only or [])]:
            if job not in jobs:
                raise fail(key, f"names job {job!r}, which is not in jobs ({', '.join(jobs)})")
        note = entry.get("note", "")
        if not isinstance(note, str):
            raise fail(f"{key}.note", "expected text")
        rows[label] = RowSpec(
            label,
            algorithm,
            overrides(entry.get("overrides"), f"{key}.overrides"),
            candidates(entry.get("candidates", [[]]), f"{key}.candidates"),
            by_job,
            tuple(only) if only is not None else None,
            " ".join(note.split()),
        )
    if not rows:
        raise fail("algorithms", "expected at least one algorithm")
    baseline = top.get("baseline", "local")
    if baseline is not None and baseline not in rows:
        raise fail(
            "baseline",
            f"got {baseline!r}, expected one of the algorithms ({', '.join(rows)}) or null",
        )
    return Spec(where, jobs, rows, baseline)


def _kind(value: Any) -> str:
    return "nothing" if value is None else type(value).__name__


# ----------------------------------------------------------------------------------------- runs
@dataclass(frozen=True)
class Run:
    """One federation: a job YAML with overrides; `key` names its resolved config."""

    job: str
    row: str
    candidate: tuple[str, ...]
    seed: int
    config: str
    overrides: tuple[str, ...]
    key: str
    hashed: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def command(self) -> str:
        return shlex.join(["silo-pfl", "run", self.config, *self.overrides])

    def describe(self) -> str:
        chosen = f" [{' '.join(self.candidate)}]" if self.candidate else ""
        return f"{self.job} {self.row}{chosen} seed {self.seed}"


@dataclass
class Record:
    """What a run gave: its results JSON (as `FederationResult.to_dict`) or why it failed."""

    result: dict[str, Any] | None
    error: str | None = None
    cached: bool = False
    elapsed_seconds: float = 0.0
    commit: str = ""


def run_overrides(job: JobSpec, row: RowSpec, candidate: Sequence[str], seed: int) -> list[str]:
    """The overrides of one run, in the order they apply: later ones win."""
    return [
        *job.overrides,
        f"algorithm.name={row.algorithm}",
        *row.overrides,
        *candidate,
        f"seed={seed}",
        *FORCED,
    ]


def hashed_config(cfg: Any) -> dict[str, Any]:
    """The resolved config as the cache key sees it: without IGNORED_KEYS, and with only the
    chosen algorithm's options section (the others cannot change the run)."""
    from silo_pfl.config import to_dict

    data = to_dict(cfg)
    for dotted in IGNORED_KEYS:
        *parents, last = dotted.split(".")
        node = data
        for part in parents:
            node = node.get(part, {})
        node.pop(last, None)
    name = data["algorithm"]["name"]
    data["algorithm"] = {"name": name, name: data["algorithm"].get(name)}
    return data


def cache_key(hashed: dict[str, Any]) -> str:
    """A hash of a `hashed_config`: equal keys, equal results."""
    from silo_pfl.results import json_default

    payload = json.dumps(
        {"cache_version": CACHE_VERSION, "config": hashed},
        sort_keys=True,
        default=json_default,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:24]


def make_run(job: JobSpec, row: RowSpec, candidate: tuple[str, ...], seed: int) -> Run:
    """Resolve and check one run's config (no Ray); a bad one fails naming job and row."""
    from silo_pfl.settings import load_config

    overrides = run_overrides(job, row, candidate, seed)
    try:
        cfg = load_config(job.config, overrides)
    except ConfigError as exc:
        if str(exc).startswith(f"config file {job.config}"):
            raise ConfigError(f"jobs.{job.label}.config: {exc}") from None
        tried = f" with candidate [{' '.join(candidate)}]" if candidate else ""
        raise ConfigError(f"algorithms.{row.label} on jobs.{job.label}{tried}: {exc}") from None
    hashed = hashed_config(cfg)
    return Run(
        job.label,
        row.label,
        candidate,
        seed,
        job.config,
        tuple(overrides),
        cache_key(hashed),
        hashed,
    )


class Cache:
    """Each run's results JSON as `<root>/<key>.json`, with the config it hashed."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def path(self, key: str) -> Path:
        return self.root / f"{key}.json"

    def get(self, key: str) -> Record | None:
        path = self.path(key)
        if not path.is_file():
            return None
        try:
            entry = json.loads(path.read_text())
            return Record(
                entry["result"],
                None,
                True,
                float(entry["elapsed_seconds"]),
                entry.get("commit", ""),
            )
        except (OSError, ValueError, KeyError, TypeError):
            return None  # unreadable: computed again and rewritten

    def put(self, run: Run, record: Record) -> None:
        from silo_pfl.results import write_json_atomic

        self.root.mkdir(parents=True, exist_ok=True)
        entry = {
            "key": run.key,
            "command": run.command,
            "job": run.job,
            "algorithm": run.row,
            "candidate": list(run.candidate),
            "seed": run.seed,
            "commit": record.commit,
            "elapsed_seconds": record.elapsed_seconds,
            "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "config": run.hashed,
            "result": record.result,
        }
        write_json_atomic(self.path(run.key), entry)


# ------------------------------------------------------------------------------ the worker side
_WORKER_RAY: dict[str, int] = {}


def _init_worker(num_cpus: int) -> None:
    """A pool process: its own fresh local Ray, used by every run it is given. The rounds'
    warnings (a silo left out, a retried round) stay in each run's results (`history`), not on
    the terminal, where the runs of several workers would mix them up.

    Ctrl-C is the parent's to handle (it then sends each worker SIGTERM): a worker ignores
    SIGINT. SIGTERM during a run stops it as `ray_session` makes it (actors released); at any
    other time it ends the worker at once; either way its Ray is shut down first."""
    import logging

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    logging.getLogger("silo_pfl").setLevel(logging.ERROR)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _terminated)
    _WORKER_RAY["num_cpus"] = num_cpus


def _terminated(signum: int, frame: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _exit_worker(128 + signum)


def _exit_worker(code: int) -> None:
    """Shut this worker's Ray down (its processes would outlive it otherwise), then exit."""
    try:
        ray = sys.modules.get("ray")
        if ray is not None:
            ray.shutdown()  # also after an init cut short: it stops the processes it started
    finally:
        os._exit(code)


RAY_START_ATTEMPTS = 3


def _ensure_ray() -> None:
    """This worker's local Ray, started on its first run. On a loaded machine Ray's raylet may
    miss its 30-second start-up deadline; then what was started is stopped and Ray tried again."""
    import logging

    import ray

    for attempt in range(1, RAY_START_ATTEMPTS + 1):
        if ray.is_initialized():
            return
        try:
            ray.init(
                address="local",
                num_cpus=_WORKER_RAY.get("num_cpus", 1),
                object_store_memory=512 * 1024**2,
                include_dashboard=False,
                log_to_driver=False,
                logging_level=logging.WARNING,
            )
        except Exception:
            ray.shutdown()
            if attempt == RAY_START_ATTEMPTS:
                raise
            time.sleep(5 * attempt)
        finally:
            signal.signal(signal.SIGTERM, _terminated)  # ray.init put in its own (sys.exit)


def execute(config: str, overrides: Sequence[str]) -> dict[str, Any]:
    """Run one federation in this process (a pool worker); its results, or why it failed.

    Its run directory is a temporary one, deleted after: only the results JSON is kept (without
    the paths into that directory)."""
    import tempfile

    start = time.perf_counter()
    try:
        from silo_pfl.federation import Federation
        from silo_pfl.settings import load_config

        _ensure_ray()
        with tempfile.TemporaryDirectory(prefix="silo_pfl_compare_") as tmp:
            cfg = load_config(config, [*overrides, f"output_dir={tmp}"])
            result = Federation(cfg).run().to_dict()
    except (KeyboardInterrupt, SystemExit):  # SIGTERM from the parent: during the run (its
        _exit_worker(130)  # actors are gone by now) or during ray.init (Ray's own handler)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {one_line(exc)}"}
    for path_key in ("run_dir", "global_state_path"):
        result.pop(path_key, None)
    return {"result": result, "elapsed_seconds": time.perf_counter() - start}


# -------------------------------------------------------------------------------- the scheduler
@dataclass
class Unit:
    """One row on one job: its candidates on the first seed, then the winner on every seed."""

    job: JobSpec
    row: RowSpec
    first: list[Run]  # one per candidate, on the job's first seed
    chosen: int | None = None  # index into first; None until chosen (or if every one failed)
    decided: bool = False
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


def mean_val_accuracy(result: dict[str, Any]) -> float:
    """The mean over silos of each silo's selected model's validation accuracy."""
    values = [float(silo["val_accuracy"]) for silo in result["silos"].values()]
    return sum(values) / len(values)


def choose_candidate(results: Sequence[dict[str, Any] | None]) -> int | None:
    """The index of the result with the best mean validation accuracy over silos (the first of
    equals); failed runs (None) never win; None if every one failed. Test accuracy is not read."""
    best: int | None = None
    for index, result in enumerate(results):
        if result is None:
            continue
        if best is None or mean_val_accuracy(result) > mean_val_accuracy(results[best]):  # type: ignore[arg-type]
            best = index
    return best


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
    def failures(self) -> list[str]:
        runs = [r for u in self.units for r in [*u.first, *u.seeds]]
        seen: dict[str, str] = {}
        for run in runs:
            record = self.records.get(run.key)
            if record is not None and record.error and run.key not in seen:
                seen[run.key] = f"{run.describe()}: {record.error}"
        return list(seen.values())


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
    """The checked-out commit (short), '+dirty' with uncommitted changes; '' outside git."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
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
    pool: cf.ProcessPoolExecutor | None = None
    commit = git_commit()
    counts = {"computed": 0, "cached": 0, "todo": 0}

    def ensure(runs: Iterable[Run]) -> None:
        nonlocal pool
        for run in runs:
            if run.key in records or run.key in queued:
                continue
            hit = store.get(run.key)
            if hit is not None:
                records[run.key] = hit
                counts["cached"] += 1
                continue
            queued.add(run.key)
            counts["todo"] += 1
            if dry_run:
                log(f"would run: {run.describe()}: {run.command}")
                continue
            if pool is None:
                pool = cf.ProcessPoolExecutor(
                    max_workers=workers,
                    mp_context=multiprocessing.get_context("spawn"),
                    initializer=_init_worker,
                    initargs=(max(1, (os.cpu_count() or 1) // workers),),
                )
            waiting[pool.submit(execute, run.config, list(run.overrides))] = run

    def advance() -> None:
        """Decide every unit whose candidates are all done; queue its winner's seeds."""
        progress = True
        while progress:
            progress = False
            for unit in units:
                if unit.decided or not all(r.key in records for r in unit.first):
                    continue
                unit.chosen = choose_candidate([records[r.key].result for r in unit.first])
                unit.decided = progress = True
                if unit.chosen is None:
                    continue
                candidate = unit.first[unit.chosen].candidate
                unit.seeds = [unit.first[unit.chosen]] + [
                    make_run(unit.job, unit.row, candidate, seed) for seed in unit.job.seeds[1:]
                ]
                ensure(unit.seeds)

    try:
        for unit in units:
            ensure(unit.first)
        advance()
        while waiting:
            done, _ = cf.wait(waiting, return_when=cf.FIRST_COMPLETED)
            for future in done:
                run = waiting.pop(future)
                queued.discard(run.key)
                try:
                    answer = future.result()
                except Exception as exc:  # the worker process died (e.g. out of memory)
                    answer = {"error": f"{type(exc).__name__}: {one_line(exc)}"}
                counts["computed"] += 1
                if "error" in answer:
                    records[run.key] = Record(None, answer["error"], commit=commit)
                    done_of = f"[{counts['computed']}/{counts['todo']}]"
                    log(f"{done_of} {run.describe()}: FAILED: {answer['error']}")
                    continue
                record = Record(answer["result"], None, False, answer["elapsed_seconds"], commit)
                records[run.key] = record
                store.put(run, record)
                result = answer["result"]
                log(
                    f"[{counts['computed']}/{counts['todo']}] {run.describe()}: test "
                    f"{result['mean_test_accuracy']:.4f} val {mean_val_accuracy(result):.4f} "
                    f"({result['wall_seconds']:.1f} s)"
                )
            advance()
    finally:
        if pool is not None and waiting:  # interrupted (or failed): stop the runs under way
            _stop_workers(pool)
        elif pool is not None:
            pool.shutdown()
    if dry_run:
        undecided = sum(1 for u in units if not u.decided)
        rest = sum(len(u.job.seeds) - 1 for u in units if not u.decided)
        log(
            f"{counts['todo']} runs to compute, {counts['cached']} from the cache"
            + (f"; then up to {rest} more once {undecided} choices are made" if undecided else "")
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

    spec = load_spec(args.spec).select(args.jobs, args.algorithms)
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
    failures = outcome.failures
    if failures:
        print(
            f"error: {len(failures)} runs failed (shown in the tables): {'; '.join(failures)}",
            file=sys.stderr,
        )
        return 1
    return 0
