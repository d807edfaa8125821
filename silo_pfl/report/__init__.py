"""The run report: an HTML page with PNG figures of one tracked federation run, read from its
MLflow store or taken from the run as it ends (data.py), drawn with matplotlib (figures.py),
laid out (html.py), and logged to the run's artifacts under report/. The tracker writes it at
the end of a run from the run itself (tracking.report); `silo-pfl report RUN_ID` builds it on
demand from the store (command.py)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from silo_pfl.report.data import RunData, check_against, read_run
from silo_pfl.report.figures import FILES, draw
from silo_pfl.report.html import render

if TYPE_CHECKING:
    from mlflow import MlflowClient

REPORT_DIR = "report"  # the artifact directory on the parent run
REPORT_FILE = "report.html"


def build(
    client: MlflowClient, run_id: str, out: Path, against_id: str | None = None, where: str = ""
) -> Path:
    """Read the run (and the run to compare with) from the store, then `write` its report."""
    run = read_run(client, run_id, "RUN_ID", where)
    against = None
    if against_id:
        against = read_run(client, against_id, "--against", where)
        check_against(run, against)
    return write(run, out, against)


def write(run: RunData, out: Path, against: RunData | None = None) -> Path:
    """Write report.html and its figures into `out` (created). They are drawn in a temporary
    directory inside `out` first: a report that fails leaves the older one as it was. Then the
    figures are moved into place, the page (which embeds them) last, each renamed whole, with
    the permissions any new file gets here (a tracking server may run as another user), and
    the older report's files that this one does not have are removed."""
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out, prefix=".report-") as tmp:
        drawn = Path(tmp)
        figures = draw(run, against, drawn)
        (drawn / REPORT_FILE).write_text(render(run, against, figures, drawn), encoding="utf-8")
        for name in (*(figure.file for figure in figures), REPORT_FILE):
            os.replace(drawn / name, out / name)
    page = out / REPORT_FILE
    for name in set(FILES) - {figure.file for figure in figures}:
        (out / name).unlink(missing_ok=True)
    return page


def publish(client: MlflowClient, run_id: str, out: Path) -> None:
    """Log the report's files in `out` (only those: `out` may hold anything else) to the run's
    artifacts, under report/, replacing the one there: a file of the older report that this one
    does not have (the gain over another run, say) is deleted first, where the store's artifact
    repository can delete; elsewhere it is left, and the page, which embeds its figures, names
    only its own."""
    from mlflow.exceptions import MlflowException
    from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

    files = [out / name for name in (*FILES, REPORT_FILE) if (out / name).is_file()]
    ours = {f"{REPORT_DIR}/{path.name}" for path in files}  # never the rest of `out`
    stale = {a.path for a in client.list_artifacts(run_id, REPORT_DIR)} - ours
    if stale:
        uri = client.get_run(run_id).info.artifact_uri
        repository = get_artifact_repository(uri, tracking_uri=client.tracking_uri)
        for path in sorted(stale):
            try:
                repository.delete_artifacts(path)
            except (NotImplementedError, OSError, MlflowException):
                break
    for path in files:
        client.log_artifact(run_id, str(path), REPORT_DIR)
