"""Each run's own directory, `<output_dir>/<name>/<run_id>/`, and finding one to resume.

The driver writes `run.json` (the run id, its kind, when it started, the resolved config) when
the run starts, marks it once round 0 is checkpointed (`checkpointed`) and writes `result.json`
when it ends. `--resume` without a run id takes the latest run that reached its first checkpoint:
one marked, finished, or whose server directory on this node holds a round's file (the runs of
earlier versions); a run stopped before (SIGKILL in its set-up) has nothing to resume. A silo's
onboarding (`silo-pfl onboard`) has a directory of the same shape beside the federation's runs,
of kind `onboard`: it cannot be resumed, so `--resume` never takes one. Silos keep their state
under `silos/<silo>/`, the server under `server/`, each on its own node's disk at the same path.
"""

from __future__ import annotations

import json
import re
import secrets
import shlex
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from silo_pfl import checkpoint
from silo_pfl.config import FederationConfig, flat, to_dict
from silo_pfl.errors import ConfigError
from silo_pfl.paths import outermost_missing
from silo_pfl.results import finite_or_null, write_json_atomic
from silo_pfl.stop_signals import signals_deferred

RUN_FILE = "run.json"
RESULT_FILE = "result.json"
FEDERATION_RUN, ONBOARD_RUN = "federation", "onboard"  # run.json's kind: what made it
CHECKPOINTED = "checkpointed_ns"  # run.json's mark: when round 0 was checkpointed
SERVER = "server"  # the server's directory in a run's, holding its checkpoints


def federation_dir(cfg: FederationConfig) -> Path:
    """Where every run of this federation has its directory."""
    return Path(cfg.output_dir).expanduser() / cfg.name


def run_path(cfg: FederationConfig, run_id: str) -> Path:
    """The directory of one run."""
    return federation_dir(cfg) / run_id


def silo_dir(cfg: FederationConfig, run_id: str, silo: str) -> Path:
    """The directory that belongs to one silo in one run, on that silo's node."""
    return run_path(cfg, run_id) / "silos" / silo


def server_dir(cfg: FederationConfig, run_id: str) -> Path:
    """The server's directory in one run, on the server's node."""
    return run_path(cfg, run_id) / SERVER


RUN_ID = re.compile(r"\d{8}-\d{6}-[0-9a-f]{6}")  # what new_run_id makes


def check_run_id(run_id: object) -> None:
    """`--resume RUN_ID`: a run directory's name. An empty one (an unset `$RUN_ID`) would
    otherwise read as no resume at all, and start a fresh run without a word; a path could
    name another federation's run."""
    if (
        not isinstance(run_id, str)
        or not run_id.strip()
        or run_id in (".", "..")
        or "/" in run_id
        or "\\" in run_id
    ):
        raise ConfigError(
            f"--resume: got {run_id!r}, expected a run id (a run directory's name, e.g. "
            "20261206-151550-10f40f), or no value for the federation's latest run"
        )


def check_resume(resume: bool | str) -> None:
    """Federation.run's `resume`: True, False, or a run id `check_run_id` accepts."""
    if resume is not True and resume is not False:
        check_run_id(resume)


def new_run_id() -> str:
    """A run id that sorts by start time: 20261130-052301-3fa9c2."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


@dataclass(frozen=True)
class RunDir:
    """One run's directory on the driver's disk."""

    run_id: str
    path: Path
    made: Path | None = None  # the outermost directory `create` made (output_dir, if new)

    @classmethod
    def create(cls, cfg: FederationConfig, kind: str = FEDERATION_RUN) -> RunDir:
        """A new run of `kind` (FEDERATION_RUN, or ONBOARD_RUN for a silo's onboarding): its
        directory, with run.json."""
        run_id = new_run_id()
        path = run_path(cfg, run_id)
        made = outermost_missing(path)
        try:
            path.mkdir(parents=True)
        except OSError as exc:
            raise ConfigError(
                f"output_dir: cannot make the run's directory {path.absolute()} "
                f"({exc.strerror or exc}); expected a directory this user can write in"
            ) from None
        record = {
            "run_id": run_id,
            "kind": kind,
            "started_ns": time.time_ns(),
            CHECKPOINTED: None,  # until round 0 is checkpointed (an earlier version wrote none)
            "config": to_dict(cfg),
        }
        write_json_atomic(path / RUN_FILE, record)
        return cls(run_id, path, made)

    @classmethod
    def find(cls, cfg: FederationConfig, run_id: str | None) -> RunDir:
        """The run to resume: `run_id`, or the latest federation run of this federation (an
        onboarding is none: it cannot be resumed)."""
        parent = federation_dir(cfg)
        if run_id is not None:
            if not (parent / run_id / RUN_FILE).is_file():
                raise ConfigError(
                    f"--resume {run_id}: no run {run_id} of {cfg.name} in {_where(cfg, parent)}"
                )
            kind = _read(parent / run_id / RUN_FILE).get("kind", FEDERATION_RUN)
            if kind != FEDERATION_RUN:
                raise ConfigError(
                    f"--resume {run_id}: a silo's onboarding (silo-pfl onboard), which cannot be "
                    f"resumed; expected the id of a federation run of {cfg.name}"
                )
            return cls(run_id, parent / run_id)
        found = parent.glob(f"*/{RUN_FILE}") if parent.is_dir() else []
        records = [(p.parent, _read(p)) for p in found]
        runs = [(p, r) for p, r in records if r.get("kind", FEDERATION_RUN) == FEDERATION_RUN]
        if not runs:
            raise ConfigError(f"--resume: no run of {cfg.name} to resume in {_where(cfg, parent)}")
        runs.sort(key=lambda run: (run[1].get("started_ns", 0), run[0].name), reverse=True)
        for path, record in runs:
            if _reached_checkpoint(path, record):
                return cls(path.name, path)
        newest = runs[0][0]
        raise ConfigError(
            f"--resume: no run of {cfg.name} to resume in {_where(cfg, parent)}: the newest, "
            f"{newest.name}, stopped before its first checkpoint ({newest / SERVER} holds no "
            "round's file on this node)"
        )

    def checkpointed(self) -> None:
        """Mark the run as resumable: the driver calls this once round 0 is checkpointed, so
        that `find` takes it even where the server's directory is on another node."""
        record = _read(self.path / RUN_FILE)
        if record.get(CHECKPOINTED) is None:
            record[CHECKPOINTED] = time.time_ns()
            write_json_atomic(self.path / RUN_FILE, record)

    def started_again(self, cfg: FederationConfig) -> None:
        """Record the config this run resumes with (it may have raised `rounds`), once it has
        been restored: a resume that fails before leaves the run as it was, result included."""
        record = _read(self.path / RUN_FILE)
        record["config"] = to_dict(cfg)
        record["resumed_ns"] = [*record.get("resumed_ns", []), time.time_ns()]
        if record.get(CHECKPOINTED) is None:  # restored from one
            record[CHECKPOINTED] = record["resumed_ns"][-1]
        with signals_deferred():  # a result beside the raised rounds: the run looks finished
            write_json_atomic(self.path / RUN_FILE, record)
            (self.path / RESULT_FILE).unlink(missing_ok=True)

    def discard(self) -> None:
        """Remove a fresh run's directory (on this node) after it failed with nothing to
        resume from, and the parents `create` made that are left empty (another run may have
        begun in them meanwhile)."""
        shutil.rmtree(self.path, ignore_errors=True)
        if self.made is None:
            return
        parent = self.path.resolve().parent
        while parent.is_relative_to(self.made):
            try:
                parent.rmdir()
            except OSError:
                return
            parent = parent.parent

    def saved_config(self) -> dict[str, Any]:
        """The resolved config the run started with."""
        return _read(self.path / RUN_FILE)["config"]

    def finished(self) -> bool:
        """Whether the run ended and wrote its result."""
        return (self.path / RESULT_FILE).is_file()


def _where(cfg: FederationConfig, parent: Path) -> str:
    """`parent` as an absolute path, saying so where output_dir is relative: a run is found
    only from the working directory it was started in."""
    if Path(cfg.output_dir).expanduser().is_absolute():
        return str(parent)
    return f"{parent.absolute()} (output_dir={cfg.output_dir} is relative to the working directory)"


def _reached_checkpoint(path: Path, record: dict[str, Any]) -> bool:
    """Whether the run at `path` checkpointed round 0, so that --resume has something to
    continue: marked so in its run.json, finished, or its server's checkpoint on this node. A
    run.json without the mark at all is an earlier version's, which wrote none: taken, as it
    was then."""
    return (
        record.get(CHECKPOINTED, True) is not None
        or (path / RESULT_FILE).is_file()
        or bool(checkpoint.rounds(path / SERVER))
    )


def _read(path: Path) -> dict[str, Any]:
    """A run's run.json: an object with the run's config."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--resume: {path} cannot be read ({exc})") from None
    if not isinstance(record, dict) or not isinstance(record.get("config"), dict):
        raise ConfigError(f"--resume: {path} is not a run's record (a JSON object with its config)")
    return record


# Keys that may change on --resume besides rounds: where and how fast it runs, not its numbers.
RESUME_FREE = ("ray.num_cpus", "ray.silos_per_worker", "round.timeout_s", "round.call_timeout_s")
SHOWN_OVERRIDES = 8  # overrides a refusal shows at most


def check_resumable(saved: dict[str, Any], cfg: FederationConfig, path: Path) -> None:
    """Only `rounds` may change on resume, and only upwards; any other change names its key
    (metrics.* may change, and tracking.* where MLflow is off, before and now).
    A key that the version which started the run did not have yet (it is not in the saved
    config) may stand at its default, which does what that version did (eval.every=1).
    Both sides are compared as run.json holds them: a value that is not finite as null."""
    before_all, given = flat(saved), _json_flat(cfg)
    after_all = finite_or_null(given)
    defaults = finite_or_null(_json_flat(FederationConfig()))
    for key in after_all.keys() - before_all.keys():
        if key in defaults and after_all[key] == defaults[key]:
            before_all[key] = defaults[key]
    both = before_all.keys() & after_all.keys()
    keys = before_all.keys() | after_all.keys()
    # Live metrics watch a run and change nothing in it: they may be turned on or tuned; so
    # may the machine's share of it and the waits (the numbers are the same bit for bit).
    free = {"rounds", *RESUME_FREE} | {k for k in keys if k.startswith("metrics.")}
    if before_all.get("tracking.enabled") is False and not cfg.tracking.enabled:
        # Without MLflow, its store (resolved against the working directory) plays no part.
        free |= {k for k in keys if k.startswith("tracking.")}
    # A key set in both is named before one only in either (an algorithm's added options).
    changed = [
        key
        for key in sorted(keys, key=lambda k: (k not in both, k))
        if key not in free and before_all.get(key) != after_all.get(key)
    ]
    if changed:
        key = changed[0]
        started = [f"{k}={_override(before_all.get(k))}" for k in changed if k in before_all]
        shown = " ".join(started[:SHOWN_OVERRIDES])
        more = (
            f" and {len(started) - SHOWN_OVERRIDES} more" if len(started) > SHOWN_OVERRIDES else ""
        )
        hint = f"; to resume it as started, give {shown}{more}" if started else ""
        raise ConfigError(
            f"{key}: got {given.get(key)!r}, but run {path.name} was started with "
            f"{before_all.get(key)!r}; on --resume only rounds may change{hint}"
        )
    if cfg.rounds < saved["rounds"]:
        raise ConfigError(
            f"rounds: got {cfg.rounds}, but run {path.name} was started with {saved['rounds']}; "
            "on --resume rounds may only be raised"
        )


def _override(value: Any) -> str:
    """`value` as a key=value override writes it."""
    if value is None:
        return "null"
    text = value if isinstance(value, str) else json.dumps(value)
    return shlex.quote(text)


def _json_flat(cfg: FederationConfig) -> dict[str, Any]:
    """The config's keys and values as its saved JSON has them, flattened."""
    return flat(json.loads(json.dumps(to_dict(cfg))))
