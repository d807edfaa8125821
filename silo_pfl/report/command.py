"""`silo-pfl report RUN_ID [--against RUN_ID] [--out DIR] [--tracking-uri URI] [--no-log]`."""

from __future__ import annotations

import shutil
from pathlib import Path

from silo_pfl.errors import ConfigError
from silo_pfl.paths import outermost_missing
from silo_pfl.report import build, publish
from silo_pfl.tracking.store import open_existing
from silo_pfl.tracking.uri import redact

DEFAULT_OUT = Path("reports")  # the report of run R goes to reports/R/ by default


def report(
    run_id: str, against: str | None, out: str | None, uri: str | None, log: bool = True
) -> Path:
    """Build the report of `run_id` into `out` and (with `log`) onto the run's artifacts;
    returns the path of report.html. If the build fails (a bad run id among them), the
    directories this call created are removed again; one that existed before is kept."""
    if out is not None and not out.strip():
        raise ConfigError(f"--out: got {out!r}, expected a directory, or no --out for the default")
    client, uri = open_existing(uri, "--tracking-uri")
    directory = Path(out) if out is not None else DEFAULT_OUT / run_id
    created = outermost_missing(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--out {directory}: cannot create it: {exc.strerror}") from None
    try:
        page = build(client, run_id, directory, against, redact(uri))
    except BaseException:
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        raise
    if log:
        publish(client, run_id, directory)
    return page
