"""`silo-pfl report RUN_ID [--against RUN_ID] [--out DIR] [--tracking-uri URI] [--no-log]`."""

from __future__ import annotations

from pathlib import Path

from silo_pfl.errors import ConfigError
from silo_pfl.report import build, publish
from silo_pfl.tracking.store import open_existing
from silo_pfl.tracking.uri import redact

DEFAULT_OUT = Path("reports")  # the report of run R goes to reports/R/ by default


def report(
    run_id: str, against: str | None, out: str | None, uri: str | None, log: bool = True
) -> Path:
    """Build the report of `run_id` into `out` and (with `log`) onto the run's artifacts;
    returns the path of report.html."""
    client, uri = open_existing(uri, "--tracking-uri")
    directory = Path(out) if out else DEFAULT_OUT / run_id
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--out {directory}: cannot create it: {exc.strerror}") from None
    page = build(client, run_id, directory, against, redact(uri))
    if log:
        publish(client, run_id, directory)
    return page
