"""One run of a comparison: its overrides and resolved config, the cache keyed by that config,
and the worker side, which runs federations in a pool process with its own local Ray."""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from silo_pfl.compare_spec import JobSpec, RowSpec
from silo_pfl.errors import ConfigError, typed_line
from silo_pfl.paths import check_dir_path
from silo_pfl.stop_signals import interrupt

CACHE_VERSION = 1  # a CSV job's key also holds its files' SHA-256 (`data_files`)
# Config keys that cannot change a run's results: where it writes, MLflow, which Ray, where
# actors are placed, how long a wait may last, whether counts per class are reported.
# Everything else is in the cache key.
IGNORED_KEYS = (
    "output_dir",
    "tracking",
    "privacy.label_counts",
    "ray",
    "silos",
    "server.node_label",
    "round.timeout_s",
    "round.call_timeout_s",
)
# every run untracked, on its worker's own local Ray (a job's cluster address and CPUs set aside)
FORCED = ("tracking.enabled=false", "ray.address=null", "ray.num_cpus=null")


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
    # False when a data file the key should hold cannot be read here: never read from nor
    # written to the cache (the run is made, and then says why it cannot read the file).
    cacheable: bool = True

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
    files = data_files(data.get("data", {}))
    if files:
        data["data_files"] = files
    return data


_DIGESTS: dict[tuple[str, int, int], str] = {}


def data_files(data: dict[str, Any]) -> dict[str, str | None]:
    """Per silo of a CSV job (`data.paths`), the SHA-256 of its file's bytes, so that an edited
    file is a new run; None for a file that cannot be read here (see `Run.cacheable`). The path
    is expanded as the silo's node does (`~`, `$VARS`); the comparison's runs are local."""
    if data.get("source") != "csv" or not isinstance(data.get("paths"), dict):
        return {}
    from silo_pfl.data.csv_source import node_path
    from silo_pfl.errors import DataError

    found: dict[str, str | None] = {}
    for silo, path in data["paths"].items():
        try:
            found[str(silo)] = file_digest(str(node_path(str(silo), path)))
        except DataError:  # a $VAR not set here: not a file this process can read
            found[str(silo)] = None
    return found


def file_digest(path: str) -> str | None:
    """The SHA-256 of a file's bytes (remembered while its size and mtime stay the same);
    None if it is not a readable file."""
    try:
        stat = os.stat(path)
        memo = (os.path.realpath(path), stat.st_size, stat.st_mtime_ns)
        if memo not in _DIGESTS:
            digest = hashlib.sha256()
            with open(path, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    digest.update(block)
            _DIGESTS[memo] = digest.hexdigest()
        return _DIGESTS[memo]
    except OSError:
        return None


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
        cacheable=None not in hashed.get("data_files", {}).values(),
    )


class Cache:
    """Each run's results JSON as `<root>/<key>.json`, with the config it hashed."""

    def __init__(self, root: str | Path) -> None:
        """A cache at `root`, which (or else its nearest existing parent) must be a directory."""
        self.root = Path(root)
        check_dir_path(self.root, f"--cache {root}")

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


_WORKER_RAY: dict[str, int] = {}
_WORKER_RUN_DIR: list[str] = []  # the temporary run directory of the run in progress, if any


def init_worker(num_cpus: int) -> None:
    """A pool process: its own fresh local Ray, used by every run it is given. The rounds'
    warnings (a silo left out, a retried round) stay in each run's results (`history`), not on
    the terminal, where the runs of several workers would mix them up.

    Ctrl-C is the parent's to handle (it then sends each worker SIGTERM): a worker ignores
    SIGINT. SIGTERM during a run stops it as `ray_session` makes it (actors released); at any
    other time it ends the worker at once; either way its Ray is shut down first, then the run's
    temporary directory is deleted."""
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
    """Shut this worker's Ray down (its processes would outlive it otherwise), delete the run
    directory its actors wrote in, then exit."""
    try:
        if "ray" in sys.modules:
            from silo_pfl.runtime.session import shutdown_local

            shutdown_local()  # also after an init cut short: it stops the processes it started
    finally:
        try:
            for path in _WORKER_RUN_DIR:
                remove_tree(path)
        finally:
            os._exit(code)


REMOVE_SECONDS = 10.0  # how long a stopped run's actors may take to stop writing


def remove_tree(path: str | Path, seconds: float = REMOVE_SECONDS) -> None:
    """Delete `path` and what is under it. An actor released a moment ago (its process is killed
    asynchronously) may still write a checkpoint there, which fails a single `rmtree` (directory
    not empty): it is tried again until `seconds` have passed, then what is left is left."""
    deadline = time.monotonic() + seconds
    while os.path.lexists(path):
        try:
            shutil.rmtree(path)
        except OSError:
            if time.monotonic() > deadline:
                return
            time.sleep(0.1)


RAY_START_ATTEMPTS = 3


def _ensure_ray() -> None:
    """This worker's local Ray, started on its first run. On a loaded machine Ray's raylet may
    miss its 30-second start-up deadline; then what was started is stopped and Ray tried again."""
    import ray

    from silo_pfl.config import RayConfig
    from silo_pfl.runtime.ray_token import ensure_local_token
    from silo_pfl.runtime.session import local_options, quiet_token_notice, shutdown_local

    ensure_local_token()
    for attempt in range(1, RAY_START_ATTEMPTS + 1):
        if ray.is_initialized():
            return
        try:
            config = RayConfig(num_cpus=_WORKER_RAY.get("num_cpus", 1))
            with quiet_token_notice():  # else each worker's Ray repeats it on the terminal
                ray.init(**local_options(config), object_store_memory=512 * 1024**2)
        except Exception:
            shutdown_local()
            if attempt == RAY_START_ATTEMPTS:
                raise
            time.sleep(5 * attempt)
        finally:
            signal.signal(signal.SIGTERM, _terminated)  # ray.init put in its own (sys.exit)


def execute_marked(
    started: str,
    key: str,
    run: Callable[[str, Sequence[str]], dict[str, Any]],
    config: str,
    overrides: Sequence[str],
) -> dict[str, Any]:
    """`run(config, overrides)` in a pool worker, after creating `<started>/<key>`: when the
    pool breaks, the parent tells the runs that had started from those that never did."""
    Path(started, key).touch()
    return run(config, overrides)


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
        _WORKER_RUN_DIR.append(tempfile.mkdtemp(prefix="silo_pfl_compare_"))
        # SIGTERM during the run: Interrupted, so that the run releases its actors
        signal.signal(signal.SIGTERM, interrupt)
        try:
            cfg = load_config(config, [*overrides, f"output_dir={_WORKER_RUN_DIR[0]}"])
            result = Federation(cfg).run().to_dict()
        finally:
            signal.signal(signal.SIGTERM, _terminated)
    except (KeyboardInterrupt, SystemExit):  # SIGTERM from the parent, during the run or during
        _exit_worker(130)  # ray.init (Ray's own handler): Ray stopped, then the directory deleted
    except Exception as exc:
        return {"error": typed_line(exc)}
    finally:
        while _WORKER_RUN_DIR:
            remove_tree(_WORKER_RUN_DIR[0])
            _WORKER_RUN_DIR.pop()
    for path_key in ("run_dir", "global_state_path"):
        result.pop(path_key, None)
    return {"result": result, "elapsed_seconds": time.perf_counter() - start}
