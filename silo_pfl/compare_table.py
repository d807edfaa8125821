"""The figures of a comparison (`silo_pfl.compare`): a JSON report, and markdown tables written
between two markers of a file (docs/RESULTS.md), leaving the rest of it as it was.

Per row and job, from each seed's results JSON: the mean, worst and std over silos of per-silo
test accuracy (the mean over seeds, with the std over seeds), the mean validation accuracy, each
silo's gain over the baseline row at the same seed (in points, averaged over seeds: the mean over
silos and the worst silo), the bytes each silo sends per round, and the wall seconds of a run.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from silo_pfl.compare import Outcome, Record, Unit, git_commit, mean_val_accuracy
from silo_pfl.errors import ConfigError

BEGIN = "<!-- compare:begin -->"
END = "<!-- compare:end -->"


# --------------------------------------------------------------------------------------- report
def report(outcome: Outcome, command: str, cache: str, json_path: str) -> dict[str, Any]:
    """Every figure of the comparison, JSON-able; the tables are made from this alone."""
    spec, records = outcome.spec, outcome.records
    jobs: dict[str, Any] = {}
    for job in spec.jobs.values():
        units = [u for u in outcome.units if u.job.label == job.label]
        base = next((u for u in units if u.row.label == spec.baseline), None)
        base_results = _seed_results(base, records) if base is not None else {}
        jobs[job.label] = {
            "config": job.config,
            "seeds": list(job.seeds),
            "overrides": list(job.overrides),
            "baseline": spec.baseline if base is not None else None,
            "algorithms": {u.row.label: _row(u, records, base_results) for u in units},
            "not_run": outcome.skipped.get(job.label, {}),
            "published": job.published,
            "notes": {u.row.label: u.row.note for u in units if u.row.note},
        }
    used = {r.key: records[r.key] for u in outcome.units for r in [*u.first, *u.seeds]}
    done = [r for r in used.values() if r.result is not None]
    return {
        "spec": spec.path,
        "command": command,
        "commit": git_commit(),
        "run_commits": sorted({r.commit for r in done if r.commit}),
        "workers": outcome.workers,
        "wall_seconds": outcome.wall_seconds,
        "runs": len(used),
        "runs_computed": outcome.computed,
        "runs_cached": outcome.cached,
        "runs_failed": len(used) - len(done),
        "runs_wall_seconds": float(sum(r.result["wall_seconds"] for r in done)),  # type: ignore[index]
        "cache": cache,
        "json": json_path,
        "jobs": jobs,
    }


def _seed_results(unit: Unit, records: dict[str, Record]) -> dict[int, dict[str, Any]]:
    """The unit's winner's results per seed (seeds that failed left out)."""
    found = {}
    for run in unit.seeds:
        record = records.get(run.key)
        if record is not None and record.result is not None:
            found[run.seed] = record.result
    return found


def _mean_std(values: list[float]) -> dict[str, float | None]:
    """The mean over seeds, and the (population) std over seeds when there are several."""
    if not values:
        return {"mean": None, "std_over_seeds": None}
    std = float(np.std(values)) if len(values) > 1 else None
    return {"mean": float(np.mean(values)), "std_over_seeds": std}


def _row(unit: Unit, records: dict[str, Record], base: dict[int, dict[str, Any]]) -> dict[str, Any]:
    candidates = []
    for index, run in enumerate(unit.first):
        record = records[run.key]
        result = record.result
        candidates.append(
            {
                "overrides": list(run.candidate),
                "key": run.key,
                "mean_val_accuracy": mean_val_accuracy(result) if result else None,
                "mean_test_accuracy": result["mean_test_accuracy"] if result else None,
                "error": record.error,
                "chosen": index == unit.chosen,
            }
        )
    row: dict[str, Any] = {
        "algorithm": unit.row.algorithm,
        "overrides": list(unit.row.overrides),
        "candidates": candidates,
        "chosen": None if unit.chosen is None else list(unit.first[unit.chosen].candidate),
        "note": unit.row.note,
    }
    if unit.chosen is None:
        row["error"] = unit.error or "every candidate failed: " + "; ".join(
            str(c["error"]) for c in candidates if c["error"]
        )
        return row
    per_seed: dict[str, Any] = {}
    for run in unit.seeds:
        record = records[run.key]
        result = record.result
        if result is None:
            per_seed[str(run.seed)] = {
                "key": run.key,
                "command": run.command,
                "error": record.error,
            }
            continue
        silos = result["silos"]
        per_seed[str(run.seed)] = {
            "key": run.key,
            "command": run.command,
            "cached": record.cached,
            "mean_test_accuracy": result["mean_test_accuracy"],
            "worst_test_accuracy": result["worst_test_accuracy"],
            "std_test_accuracy": result["std_test_accuracy"],
            "mean_val_accuracy": mean_val_accuracy(result),
            "test_accuracy": {s: v["test_accuracy"] for s, v in silos.items()},
            "val_accuracy": {s: v["val_accuracy"] for s, v in silos.items()},
            "bytes_sent_per_round": {s: v["bytes_sent_per_round"] for s, v in silos.items()},
            "wall_seconds": result["wall_seconds"],
        }
    ok = [v for v in per_seed.values() if "error" not in v]
    row["seeds"] = per_seed
    row["failed_seeds"] = {s: v["error"] for s, v in per_seed.items() if "error" in v}
    if not ok:
        row["error"] = "every seed failed (each one's error below)"
    for figure in ("mean_test_accuracy", "worst_test_accuracy", "std_test_accuracy"):
        row[figure] = _mean_std([v[figure] for v in ok])
    row["mean_val_accuracy"] = _mean_std(
        [v["mean_val_accuracy"] for v in ok if v["mean_val_accuracy"] is not None]
    )["mean"]
    row["bytes_sent_per_round"] = (
        float(np.mean([np.mean(list(v["bytes_sent_per_round"].values())) for v in ok]))
        if ok
        else None
    )
    row["wall_seconds"] = float(np.mean([v["wall_seconds"] for v in ok])) if ok else None
    row["gain_over_baseline"] = gains(
        {int(s): v["test_accuracy"] for s, v in per_seed.items() if "error" not in v},
        {s: {k: v["test_accuracy"] for k, v in r["silos"].items()} for s, r in base.items()},
    )
    return row


def gains(
    row: dict[int, dict[str, float]], base: dict[int, dict[str, float]]
) -> dict[str, Any] | None:
    """Each silo's test accuracy minus the baseline's at the same seed, in points, averaged over
    the seeds both have; the mean over silos and the worst silo. Only the silos both have at
    every such seed count (a row may federate other silos: other `data.paths`, `num_silos`);
    the others are listed in `silos_not_compared`. None without a common seed or silo."""
    seeds = sorted(set(row) & set(base))
    if not seeds:
        return None
    silos = [s for s in row[seeds[0]] if all(s in row[x] and s in base[x] for x in seeds)]
    every = {s for x in seeds for s in (*row[x], *base[x])}
    if not silos:
        return None
    per_silo = {
        s: float(np.mean([100 * (row[seed][s] - base[seed][s]) for seed in seeds])) for s in silos
    }
    worst = min(per_silo, key=per_silo.__getitem__)
    return {
        "seeds": seeds,
        "per_silo_points": per_silo,
        "mean_points": float(np.mean(list(per_silo.values()))),
        "worst_silo": worst,
        "worst_silo_points": per_silo[worst],
        "silos_not_compared": sorted(every - set(silos)),
    }


# ------------------------------------------------------------------------------------- markdown
def markdown(data: dict[str, Any]) -> str:
    """The region's text: how to read it, the command, the cost, then a table per job."""
    runs = data["runs"]
    commit = data["commit"] or "unknown"
    made_at = ", ".join(data["run_commits"]) or "none"
    lines = [
        "## Every algorithm on every job (`silo-pfl compare`)",
        f"`{data['command']}`",
        "",
        f"Written at commit {commit}; its {runs} runs were made at commit(s) {made_at}. This "
        f"invocation took {_duration(data['wall_seconds'])} with {data['workers']} worker(s), "
        f"computing {data['runs_computed']} runs and reading {data['runs_cached']} from the "
        f"cache (`{data['cache']}`); the runs' own wall times add up to "
        f"{_duration(data['runs_wall_seconds'])}. Every figure, per seed and per silo, with the "
        f"command of each run: `{data['json']}`.",
        "",
        "Per run, each silo's selected personalized model (round chosen on validation) is scored "
        "on its own test set: *mean*, *worst* and *std* are over silos; each is the mean over "
        "seeds, ± the (population) std over seeds where there are several. *Gain*: each silo's "
        "test accuracy minus the baseline's at the same seed, averaged over seeds, in points; the "
        "mean over silos and the worst silo. *val*: mean validation accuracy over silos. *Bytes*: "
        "what each silo sends per round. *s*: wall seconds of one run. Hyper-parameters: when "
        "several candidates are listed, each ran on the job's first seed and the one with the "
        "best val ran on every seed; test accuracy chose nothing.",
    ]
    for label, job in data["jobs"].items():
        lines += ["", *_job_table(label, job)]
    notes = {}
    for job in data["jobs"].values():
        notes.update(job["notes"])
    if notes:
        lines += ["", "How each row's candidates were picked:"]
        lines += [f"- {row}: {note}" for row, note in notes.items()]
    return "\n".join(lines) + "\n"


def _job_table(label: str, job: dict[str, Any]) -> list[str]:
    seeds = " ".join(str(s) for s in job["seeds"])
    extra = f", overrides `{' '.join(job['overrides'])}`" if job["overrides"] else ""
    plural = "s" if len(job["seeds"]) > 1 else ""
    lines = [f"### {label} (`{job['config']}`, seed{plural} {seeds}{extra})"]
    published = job.get("published") or {}
    figures = published.get("figures", {})
    rows = job["algorithms"]
    base = job["baseline"] or "baseline"
    header = [
        "algorithm",
        "hyper-parameters",
        "mean",
        "worst",
        "std",
        f"gain over {base}",
        "worst silo's gain",
        "val",
        "bytes",
        "s",
    ]
    ours_published = [name for name in figures if name in rows]
    if ours_published:
        header.append("published")
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    scored = [r for r in rows if rows[r].get("mean_test_accuracy", {}).get("mean") is not None]
    # A row some of whose seeds failed is ranked after every row that has them all: its mean is
    # over the seeds that finished, which may be the easy ones.
    scored.sort(key=lambda r: (bool(_failed(rows[r])), -rows[r]["mean_test_accuracy"]["mean"]))
    best = scored[0] if scored and not _failed(rows[scored[0]]) else None
    for name in [*scored, *[r for r in rows if r not in scored]]:
        row = rows[name]
        cells = [name, _hyper(row)]
        if name in scored:
            mean = _pm(row["mean_test_accuracy"])
            finished = [s for s in row["seeds"] if s not in _failed(row)]
            if _failed(row):
                mean += _only(finished)
            cells += [
                f"**{mean}**" if name == best else mean,
                _pm(row["worst_test_accuracy"]),
                _pm(row["std_test_accuracy"]),
                *_gain_cells(row.get("gain_over_baseline"), name == job["baseline"], finished),
                _val(row["mean_val_accuracy"]),
                f"{row['bytes_sent_per_round']:,.0f}",
                f"{row['wall_seconds']:.1f}",
            ]
        else:
            cells += ["failed: " + row.get("error", "")] + [""] * 7
        if ours_published:
            cells.append(f"{figures[name]:.4f}" if name in figures else "")
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    for name, row in rows.items():
        for seed, error in (row.get("failed_seeds") or {}).items():
            lines.append(f"\n{name}, seed {seed} failed: {error}")
    if job["not_run"]:
        skipped = "; ".join(f"{r} ({why})" for r, why in job["not_run"].items())
        lines += ["", f"Not run on this job: {skipped}."]
    if published:
        others = [f"{n} {v:.4f}" for n, v in figures.items() if n not in rows]
        lines += [
            "",
            f"*published*: {published.get('source', '').strip()}."
            + (f" Also: {', '.join(others)}." if others else "")
            + (f" {published['note'].strip()}." if published.get("note") else ""),
        ]
    return lines


def _failed(row: dict[str, Any]) -> dict[str, str]:
    """The row's seeds that failed: {seed: error}."""
    return row.get("failed_seeds") or {}


def _hyper(row: dict[str, Any]) -> str:
    fixed = " ".join(_short(o) for o in row["overrides"])
    candidates = row["candidates"]
    if len(candidates) == 1:
        chosen = " ".join(_short(o) for o in candidates[0]["overrides"])
        return " ".join(p for p in (fixed, chosen) if p) or "the job's"
    parts = []
    for c in candidates:
        name = " ".join(_short(o) for o in c["overrides"]) or "the job's"
        val = "failed" if c["error"] else f"val {_val(c['mean_val_accuracy'])}"
        parts.append(f"**{name}** ({val})" if c["chosen"] else f"{name} ({val})")
    return (fixed + "; " if fixed else "") + "chosen of: " + ", ".join(parts)


def _val(value: float | None) -> str:
    """A mean validation accuracy; n/a when no silo had validation rows."""
    return "n/a" if value is None else f"{value:.4f}"


def _short(override: str) -> str:
    """`algorithm.moe_heads.experts=10` -> `experts=10`: the row names the algorithm."""
    key, _, value = override.partition("=")
    parts = key.split(".")
    if len(parts) == 3 and parts[0] == "algorithm":
        key = parts[2]
    return f"{key}={value}"


def _pm(figure: dict[str, float | None]) -> str:
    mean, std = figure["mean"], figure["std_over_seeds"]
    if mean is None:
        return ""
    return f"{mean:.4f}" if std is None else f"{mean:.4f} ± {std:.4f}"


def _only(seeds: list[str]) -> str:
    """` (seed 0 only)`, ` (seeds 0 2 only)`."""
    return f" (seed{'s' if len(seeds) > 1 else ''} {' '.join(seeds)} only)"


def _gain_cells(gain: dict[str, Any] | None, is_base: bool, finished: list[str]) -> list[str]:
    """The gain over the baseline and the worst silo's; the gain names its seeds when they are
    not all of the row's `finished` seeds (the baseline failed on the others)."""
    if gain is None:
        return ["", ""]
    if is_base:
        return ["(baseline)", ""]
    left_out = gain.get("silos_not_compared") or []
    over = f" (not: {', '.join(left_out)})" if left_out else ""
    seeds = [str(s) for s in gain["seeds"]]
    if sorted(seeds) != sorted(finished):
        over += _only(seeds)
    return [
        f"{gain['mean_points']:+.1f}{over}",
        f"{gain['worst_silo_points']:+.1f} ({gain['worst_silo']})",
    ]


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


# -------------------------------------------------------------------------------------- writing
def check_outputs(out: str, json_path: str) -> None:
    """Fail before anything runs if either output is not a file path that can be written, or
    `out` has broken markers."""
    for option, path in (("--out", out), ("--json", json_path)):
        if not path.strip():
            raise ConfigError(f"{option}: got {path!r}, expected a file path")
        if Path(path).is_dir():
            raise ConfigError(f"{option} {path}: is a directory, expected a file path")
        parent = Path(path).resolve().parent
        if not parent.is_dir():
            raise ConfigError(f"{option} {path}: directory {parent} does not exist")
        if not os.access(parent, os.W_OK):
            raise ConfigError(f"{option} {path}: directory {parent} is not writable")
    if Path(out).is_file():
        _split(Path(out).read_text(), out)


def _split(text: str, path: str) -> tuple[str, str] | None:
    """(before the region, after it), or None when `text` has no region; broken markers fail."""
    begins, ends = text.count(BEGIN), text.count(END)
    if begins == ends == 0:
        return None
    if begins != 1 or ends != 1 or text.index(BEGIN) > text.index(END):
        raise ConfigError(
            f"--out {path}: expected one {BEGIN} line before one {END} line (found {begins} and "
            f"{ends}); fix the file or name another with --out"
        )
    before, rest = text.split(BEGIN, 1)
    return before, rest.split(END, 1)[1]


def replace_region(path: str | Path, body: str) -> None:
    """Put `body` between the markers of `path` (appended with them if absent; the file is
    created if missing), atomically; the rest of the file is kept byte for byte."""
    target = Path(path)
    text = target.read_text() if target.is_file() else ""
    parts = _split(text, str(path))
    if parts is None:
        before, after = (text.rstrip("\n") + "\n\n" if text.strip() else ""), "\n"
    else:
        before, after = parts
    _write_text(target, f"{before}{BEGIN}\n{body}{END}{after}")


def _write_text(target: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write(data: dict[str, Any], out: str, json_path: str) -> None:
    """The JSON report and the markdown region (made first: a failure writes neither)."""
    from silo_pfl.results import write_json_atomic

    body = markdown(data)
    write_json_atomic(json_path, data)
    replace_region(out, body)
