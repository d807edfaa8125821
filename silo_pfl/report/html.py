"""The report's page: one self-contained HTML file (inline CSS, no script, no external font).

Its figures are embedded as data: URIs. mlflow ui previews an HTML artifact inside a frame of
its own page, where a relative link to a PNG beside it would not resolve; the PNG files are
written beside the page all the same.
"""

from __future__ import annotations

import base64
import math
from html import escape
from pathlib import Path

from silo_pfl.report.data import RunData
from silo_pfl.report.figures import Figure

STYLE = """
body { font-family: sans-serif; margin: 2em auto; max-width: 1150px; color: #212121; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 1.6em; }
table { border-collapse: collapse; margin: 0.5em 0; }
th, td { border: 1px solid #bdbdbd; padding: 0.25em 0.7em; text-align: right; }
th { background: #eeeeee; } td.name, th.name { text-align: left; }
td.gain { color: #2e7d32; } td.loss { color: #c62828; }
figure { margin: 0.5em 0; } img { max-width: 100%; border: 1px solid #e0e0e0; }
figcaption, p.note { color: #555555; font-size: 0.9em; }
"""


def _number(value: float, digits: int = 3) -> str:
    return "-" if math.isnan(value) else f"{value:.{digits}f}"


def _header(run: RunData, against: RunData | None) -> str:
    rows = [
        ("federation", run.federation),
        ("run id", run.run_id),
        ("algorithm", run.algorithm),
        ("seed", run.seed),
        ("rounds", str(run.rounds)),
        *(
            [("status", f"{run.status}, not finished: the figures are of the rounds it logged")]
            if run.status != "FINISHED"
            else []
        ),
        ("silos", str(len(run.silos))),
        (
            "selected test accuracy over silos",
            f"mean {_number(run.mean_test)}, worst "
            f"{_number(run.worst_test)}, std {_number(run.std_test)}",
        ),
        ("wall time", f"{_number(run.wall_seconds, 1)} s"),
        ("secure aggregation", "on" if run.secure else "off"),
    ]
    if against is not None:
        rows.append(
            (
                "compared with",
                f"run {against.run_id} ({against.algorithm}): mean "
                f"{_number(against.mean_test)}, worst {_number(against.worst_test)}, std "
                f"{_number(against.std_test)}",
            )
        )
    cells = "".join(
        f'<tr><th class="name">{escape(k)}</th><td class="name">{escape(v)}</td></tr>'
        for k, v in rows
    )
    return f"<table>{cells}</table>"


def _silo_table(run: RunData, against: RunData | None) -> str:
    head = ["silo", "selected round", "val accuracy", "test accuracy"]
    if against is not None:
        head += [f"test accuracy ({against.algorithm})", "gain (points)"]
    lines = [
        "<tr>"
        + "".join(
            f'<th class="{"name" if i == 0 else ""}">{escape(h)}</th>' for i, h in enumerate(head)
        )
        + "</tr>"
    ]
    for silo in run.silos.values():
        cells = [
            f'<td class="name">{escape(silo.name)}</td>',
            f"<td>{'-' if silo.selected_round is None else silo.selected_round}</td>",
            f"<td>{_number(silo.selected_val_accuracy)}</td>",
            f"<td>{_number(silo.selected_test_accuracy)}</td>",
        ]
        if against is not None:
            other = against.silos.get(silo.name)
            if other is None:
                cells += ["<td>-</td>", "<td>-</td>"]
            else:
                points = 100 * (silo.selected_test_accuracy - other.selected_test_accuracy)
                kind = "gain" if points > 0 else "loss" if points < 0 else ""
                cells += [
                    f"<td>{_number(other.selected_test_accuracy)}</td>",
                    f'<td class="{kind}">{points:+.1f}</td>',
                ]
        lines.append("<tr>" + "".join(cells) + "</tr>")
    return "<table>" + "".join(lines) + "</table>"


def _notes(run: RunData, against: RunData | None) -> list[str]:
    notes = []
    if against is None and run.selected:
        notes.append(
            "No run to compare with: <code>silo-pfl report "
            f"{escape(run.run_id)} --against OTHER_RUN_ID</code> adds each silo's gain over "
            "another run of this federation (e.g. fedavg, or local)."
        )
    if not run.selected:
        notes.append(
            f"No selection: the run did not finish ({escape(run.status)}), so no silo kept a "
            "model; the table shows - for the selected round and its accuracies."
        )
    if run.partition is None:
        why = (
            "under secure aggregation the silos report no rows per class"
            if run.secure
            else "the run logged no label counts"
        )
        notes.append(f"No partition figure: {why}.")
    return [f'<p class="note">{n}</p>' for n in notes]


def _figure(figure: Figure, out: Path) -> str:
    data = base64.b64encode((out / figure.file).read_bytes()).decode("ascii")
    return (
        f"<h2>{escape(figure.title)}</h2><figure>"
        f'<img src="data:image/png;base64,{data}" alt="{escape(figure.title)}">'
        f"<figcaption>{escape(figure.caption)} ({escape(figure.file)})</figcaption></figure>"
    )


def render(run: RunData, against: RunData | None, figures: list[Figure], out: Path) -> str:
    """The whole page; the figures' PNGs are read from `out`."""
    title = f"Run report: {run.federation} / {run.algorithm} / {run.run_id}"
    body = [
        f"<h1>{escape(title)}</h1>",
        _header(run, against),
        *_notes(run, against),
        "<h2>Silos</h2>",
        _silo_table(run, against),
        *(_figure(f, out) for f in figures),
    ]
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f'<link rel="icon" href="data:,">\n<title>{escape(title)}</title>\n'
        f"<style>{STYLE}</style>\n</head>\n<body>\n" + "\n".join(body) + "\n</body>\n</html>\n"
    )
