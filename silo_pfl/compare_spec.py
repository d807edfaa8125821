"""A comparison's spec (jobs/compare/all.yaml by default): its jobs, its rows (algorithms with
their overrides and candidate overrides) and the baseline row; read and checked with one-line
errors naming the key."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from silo_pfl.errors import ConfigError, one_line

# Set by the comparison itself, so not allowed in a spec's overrides.
RESERVED_KEYS = ("seed", "algorithm.name", "output_dir", "tracking.", "ray.")


def _reserved(name: str) -> str:
    """The reserved key an override of `name` would set ('' if none): the key itself, a key
    under a reserved section, or a section that holds one (`algorithm={name: fedavg}`)."""
    for reserved in RESERVED_KEYS:
        key = reserved.rstrip(".")
        under = reserved.endswith(".") and name.startswith(reserved)
        if name == key or under or key.startswith(name + "."):
            return name if name == key or under else key
    return ""


_SPEC_KEYS = ("baseline", "jobs", "algorithms")
_JOB_KEYS = ("config", "seeds", "overrides", "published")
_ROW_KEYS = ("algorithm", "overrides", "candidates", "candidates_by_job", "only_jobs", "note")
_PUBLISHED_KEYS = ("source", "note", "figures")


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

    def select(
        self,
        jobs: Sequence[str] | None,
        rows: Sequence[str] | None,
        max_seeds: int | None = None,
    ) -> Spec:
        """The same spec restricted to these jobs and rows (None: all) and to each job's first
        `max_seeds` seeds (None: all); unknown names fail."""
        if max_seeds is not None and max_seeds < 1:
            raise ConfigError(f"--max-seeds: got {max_seeds}, expected >= 1")
        return Spec(
            self.path,
            {
                j: dataclasses.replace(self.jobs[j], seeds=self.jobs[j].seeds[:max_seeds])
                for j in _known(jobs, self.jobs, "--jobs")
            },
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
    from omegaconf.errors import OmegaConfBaseException

    from silo_pfl.config import read_yaml

    try:
        raw = OmegaConf.to_container(read_yaml(Path(path)), resolve=True)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None)
        where = f"{key}: " if key else ""
        raise ConfigError(f"{path}: {where}{one_line(exc)}") from None
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
            reserved = _reserved(name)
            if reserved:
                held = "" if reserved == name else f" holds {reserved}, which"
                raise fail(key, f"{item!r}: {name}{held} is set by the comparison itself")
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
            for name in ("source", "note"):
                text = published.get(name)
                if name in published and (not isinstance(text, str) or not text.strip()):
                    raise fail(f"{key}.published.{name}", f"expected non-empty text, got {text!r}")
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
