"""The run report of real tracked federations (real Ray, a real SQLite store), read back by
`silo-pfl report`, rendered by headless Chromium, and browsed in a real `mlflow ui`."""

from __future__ import annotations

import base64
import dataclasses
import html
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from drivers import StopAfter
from matplotlib.image import imread
from mlflow import MlflowClient
from processes import stop_group, wait_for_http

from silo_pfl.cli import main
from silo_pfl.federation import Federation
from silo_pfl.results import FederationResult
from silo_pfl.settings import load_config

HOSPITALS = ["cleveland", "hungarian", "switzerland", "va"]
FIGURES = {"accuracy.png", "spread.png", "bytes.png", "partition.png"}
PAGE = "report/report.html"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
BIN = Path(sys.executable).parent
STARTUP_SECONDS = 300  # mlflow ui takes minutes on a busy 2-core machine
needs_chromium = pytest.mark.skipif(
    not Path("/usr/bin/chromium").exists(), reason="Debian's chromium is not installed"
)


@dataclass(frozen=True)
class Runs:
    """Three tracked runs in one store: fedper and fedavg (evaluated in rounds 2 and 3 only,
    eval.every=2) of heart_disease, and a secure run of another federation with the automatic
    report off."""

    uri: str
    root: Path
    fedper: FederationResult
    fedavg: FederationResult
    secure: FederationResult

    @staticmethod
    def run_id(result: FederationResult) -> str:
        return str(result.extras["mlflow"]["run_id"])


@pytest.fixture(scope="module")
def runs(ray_local, tmp_path_factory) -> Runs:
    root = tmp_path_factory.mktemp("report")
    uri = f"sqlite:///{root / 'mlflow.db'}"

    def run(*overrides: str) -> FederationResult:
        options = [f"tracking.uri={uri}", f"output_dir={root / 'runs'}", "rounds=3", *overrides]
        return Federation(load_config("jobs/heart_disease.yaml", options)).run()

    return Runs(
        uri,
        root,
        fedper=run(),
        fedavg=run("algorithm.name=fedavg", "eval.every=2"),
        secure=run("name=heart_secure", "aggregation.secure=true", "tracking.report=false"),
    )


@pytest.fixture(scope="module")
def unfinished(runs) -> str:
    """The MLflow run id of a fedper run of heart_disease in the runs' store, interrupted in its
    second round: KILLED, its silos' rounds logged but no selected model."""
    options = [f"tracking.uri={runs.uri}", f"output_dir={runs.root / 'runs'}", "rounds=3"]
    federation = Federation(
        load_config("jobs/heart_disease.yaml", options), callbacks=[StopAfter(2)]
    )
    with pytest.raises(KeyboardInterrupt):
        federation.run()
    client = MlflowClient(runs.uri)
    killed = client.search_runs(
        [client.get_run(Runs.run_id(runs.fedper)).info.experiment_id],
        "attributes.status = 'KILLED'",
    )
    (parent,) = [run for run in killed if "mlflow.parentRunId" not in run.data.tags]
    return parent.info.run_id


def artifacts(uri: str, run_id: str, path: str = "") -> set[str]:
    return {a.path for a in MlflowClient(uri).list_artifacts(run_id, path or None)}


def assert_png(path: Path) -> None:
    assert path.read_bytes()[:8] == PNG_SIGNATURE, path
    height, width = imread(path).shape[:2]
    assert height >= 200 and width >= 400, (path, height, width)


def report(runs: Runs, run_id: str, out: Path, *more: str) -> list[str]:
    return ["report", run_id, "--out", str(out), "--tracking-uri", runs.uri, *more]


def test_every_tracked_run_ends_with_its_report(runs):
    run_id = Runs.run_id(runs.fedavg)
    client = MlflowClient(runs.uri)
    assert client.get_run(run_id).info.status == "FINISHED"
    assert artifacts(runs.uri, run_id, "report") == {
        f"report/{name}" for name in (*FIGURES, "report.html")
    }
    local = Path(runs.fedavg.run_dir) / "report"
    page = (local / "report.html").read_text()
    for hospital in HOSPITALS:
        assert f'<td class="name">{hospital}</td>' in page
    for name in FIGURES:
        assert_png(local / name)
        embedded = base64.b64encode((local / name).read_bytes()).decode()
        assert f'src="data:image/png;base64,{embedded}"' in page, name
    partition = json.loads(
        Path(client.download_artifacts(run_id, "partition.json", str(runs.root))).read_text()
    )["silos"]
    assert sorted(partition) == HOSPITALS
    for hospital, counts in partition.items():
        silo = runs.fedavg.silos[hospital]
        assert len(counts) == 2 and sum(counts) == silo.num_train, hospital


def test_the_result_logged_to_mlflow_is_strict_json_and_the_run_directorys(runs, tmp_path):
    """Between evaluations a round's means are not numbers: null in JSON, never a bare NaN."""
    run_id = Runs.run_id(runs.fedavg)
    logged = MlflowClient(runs.uri).download_artifacts(run_id, "result.json", str(tmp_path))
    text = Path(logged).read_text()

    def refuse(constant: str) -> None:
        raise ValueError(f"not JSON: {constant}")

    assert json.loads(text, parse_constant=refuse)["history"][0]["mean_val_accuracy"] is None
    assert text == (Path(runs.fedavg.run_dir) / "result.json").read_text()


def test_the_report_a_run_writes_as_it_ends_equals_the_one_read_back_from_the_store(runs, tmp_path):
    """The tracker writes the report from the run itself, without reading the store back; the
    same report, byte for byte, comes from what the store holds; also where rounds between
    evaluations logged no accuracies (eval.every)."""
    client = MlflowClient(runs.uri)
    parent = client.get_run(Runs.run_id(runs.fedavg))
    child = client.search_runs(
        [parent.info.experiment_id],
        f"tags.mlflow.parentRunId = '{parent.info.run_id}' and tags.silo = 'cleveland'",
    )[0]
    steps = {
        key: sorted(m.step for m in client.get_metric_history(run_id, key))
        for run_id, key in [
            (child.info.run_id, "val_accuracy"),
            (child.info.run_id, "bytes_sent"),
            (parent.info.run_id, "round_mean_val_accuracy"),
            (parent.info.run_id, "round_mean_train_loss"),
            (parent.info.run_id, "round_mean_test_accuracy"),
            (parent.info.run_id, "mean_test_accuracy"),  # the final figure: one value
        ]
    }
    assert list(steps.values()) == [[2, 3], [1, 2, 3], [2, 3], [1, 2, 3], [2, 3], [3]]
    for result in (runs.fedper, runs.fedavg):
        out = tmp_path / Runs.run_id(result)
        assert main(report(runs, Runs.run_id(result), out, "--no-log")) == 0
        written = Path(result.run_dir) / "report"
        for name in (*FIGURES, "report.html"):
            assert (written / name).read_bytes() == (out / name).read_bytes(), name


def test_report_against_fedavg_shows_each_silos_gain(runs, tmp_path, capsys):
    run_id, against = Runs.run_id(runs.fedper), Runs.run_id(runs.fedavg)
    out = tmp_path / "out"
    assert main(report(runs, run_id, out, "--against", against)) == 0
    assert capsys.readouterr().out.startswith(f"report written to {out / 'report.html'}")
    page = (out / "report.html").read_text()
    for name in (*FIGURES, "gain.png"):
        assert_png(out / name)
    assert run_id in page and against in page
    assert f"mean {runs.fedper.mean_test_accuracy:.3f}" in page
    assert f"worst {runs.fedper.worst_test_accuracy:.3f}" in page
    for hospital in HOSPITALS:
        gain = runs.fedper.silos[hospital].test_accuracy - runs.fedavg.silos[hospital].test_accuracy
        row = re.search(rf'<td class="name">{hospital}</td>(.*?)</tr>', page)
        assert row is not None, hospital
        assert f">{100 * gain:+.1f}</td>" in row.group(1), (hospital, row.group(1))
    logged = artifacts(runs.uri, run_id, "report")
    assert {"report/report.html", "report/gain.png"} <= logged
    again = tmp_path / "again"  # a report without --against replaces it: no gain figure left
    (again / "notes").mkdir(parents=True)  # nor anything else --out held: only the report goes
    (again / "patients.csv").write_text("age,sex\n63,1\n")
    (again / "notes" / "todo.txt").write_text("a file of the user's")
    assert main(report(runs, run_id, again)) == 0
    assert artifacts(runs.uri, run_id, "report") == {
        f"report/{name}" for name in (*FIGURES, "report.html")
    }


def test_figures_are_the_same_bytes_every_time(runs, tmp_path):
    run_id = Runs.run_id(runs.fedper)
    for name in ("a", "b"):
        assert main(report(runs, run_id, tmp_path / name, "--no-log")) == 0
    for figure in FIGURES:
        assert (tmp_path / "a" / figure).read_bytes() == (tmp_path / "b" / figure).read_bytes()


def test_secure_aggregation_reports_no_label_counts(runs, tmp_path):
    run_id = Runs.run_id(runs.secure)
    logged = artifacts(runs.uri, run_id)
    assert "partition.json" not in logged
    assert "report" not in logged, "tracking.report=false: no report at the end of the run"
    assert not (Path(runs.secure.run_dir) / "report").exists()
    out = tmp_path / "out"
    assert main(report(runs, run_id, out)) == 0
    page = (out / "report.html").read_text()
    assert not (out / "partition.png").exists() and "partition.png" not in page
    assert "under secure aggregation the silos report no rows per class" in page
    assert {"report/report.html", "report/accuracy.png"} <= artifacts(runs.uri, run_id, "report")


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--against", "0123456789abcdef"], "--against 0123456789abcdef: no such run"),
        (["--against", "{secure}"], "a run of federation 'heart_secure', not 'heart_disease'"),
        (["--against", "{fedper}"], "that is the run itself"),
    ],
    ids=["unknown", "other-federation", "itself"],
)
def test_report_refuses_a_bad_against_run_in_one_line(runs, tmp_path, capsys, args, expected):
    ids = {"secure": Runs.run_id(runs.secure), "fedper": Runs.run_id(runs.fedper)}
    args = [a.format(**ids) for a in args]
    assert main(report(runs, ids["fedper"], tmp_path / "out", *args)) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err and expected in err, err


def test_a_run_to_compare_with_that_shares_no_silo_is_refused_in_one_line(runs):
    """Each silo's gain is its own accuracy in one run minus in the other: runs of one
    federation's name whose silos are all others have no gain to draw."""
    from silo_pfl.errors import ConfigError
    from silo_pfl.report.data import check_against, read_run

    client = MlflowClient(runs.uri)
    run = read_run(client, Runs.run_id(runs.fedper), "RUN_ID")
    against = read_run(client, Runs.run_id(runs.fedavg), "--against")
    check_against(run, against)
    renamed = dataclasses.replace(against, silos={f"x{k}": v for k, v in against.silos.items()})
    with pytest.raises(ConfigError, match=r"^--against \w+: its silos \(xcleveland, .*share none"):
        check_against(run, renamed)


def test_report_refuses_unknown_runs_and_stores_in_one_line(runs, tmp_path, capsys):
    child = MlflowClient(runs.uri).search_runs(
        [MlflowClient(runs.uri).get_run(Runs.run_id(runs.fedper)).info.experiment_id],
        "tags.silo = 'va'",
    )[0]
    cases = [
        (report(runs, "0123456789abcdef", tmp_path), "RUN_ID 0123456789abcdef: no such run"),
        (
            report(runs, Path(runs.fedper.run_dir).name, tmp_path),
            "that is a run's directory id: give its MLflow run id",
        ),
        (report(runs, child.info.run_id, tmp_path), "not a federation run"),
        (
            ["report", "x", "--tracking-uri", f"sqlite:///{tmp_path / 'none.db'}"],
            "no MLflow store at",
        ),
    ]
    for args, expected in cases:
        assert main(args) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and "Traceback" not in err and expected in err, err


def test_report_says_a_run_did_not_finish_and_refuses_a_deleted_one(runs, tmp_path, capsys):
    """On a copy of the store: a killed run's page says so; a deleted run, or one whose
    experiment is deleted, is one line saying how to restore it."""
    store = tmp_path / "copy.db"
    shutil.copyfile(runs.root / "mlflow.db", store)
    uri, run_id = f"sqlite:///{store}", Runs.run_id(runs.fedper)
    client = MlflowClient(uri)
    client.set_terminated(run_id, "KILLED")
    args = ["report", run_id, "--tracking-uri", uri, "--no-log"]
    assert main([*args, "--out", str(tmp_path / "killed")]) == 0, capsys.readouterr().err
    page = (tmp_path / "killed" / "report.html").read_text()
    assert '<th class="name">status</th><td class="name">KILLED, not finished' in page
    client.delete_run(run_id)
    assert main([*args, "--out", str(tmp_path / "deleted")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"error: RUN_ID {run_id}: the run is deleted in {uri}; restore it first "
        f"(mlflow runs restore --run-id {run_id})"
    )
    client.restore_run(run_id)
    experiment = client.get_run(run_id).info.experiment_id
    client.delete_experiment(experiment)
    assert main([*args, "--out", str(tmp_path / "gone")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: RUN_ID {run_id}: its experiment heart_disease is deleted")
    assert err.endswith(f"(mlflow experiments restore --experiment-id {experiment})")


def keep_screens(*shots: Path) -> None:
    """Copy screenshots to $SILO_PFL_SCREENS, when set, for a person to look at."""
    target = os.environ.get("SILO_PFL_SCREENS")
    if target:
        Path(target).mkdir(parents=True, exist_ok=True)
        for shot in shots:
            shutil.copy(shot, Path(target) / shot.name)


@needs_chromium
def test_report_renders_in_chromium_without_console_errors(runs, tmp_path):
    from browser import IMAGES_LOADED, chromium

    out = tmp_path / "out"
    against = Runs.run_id(runs.fedavg)
    assert main(report(runs, Runs.run_id(runs.fedper), out, "--against", against, "--no-log")) == 0
    with chromium() as page:
        page.open((out / "report.html").as_uri())
        text = page.text()
        loaded = page.evaluate(IMAGES_LOADED)
        shot = page.screenshot(tmp_path / "report_chromium.png")
        errors = page.errors
    keep_screens(shot)
    assert errors == []
    assert loaded is True
    assert all(hospital in text for hospital in HOSPITALS)
    assert_png(shot)
    assert imread(shot).shape[0] > 2000  # the whole page, not only the window


@pytest.fixture
def mlflow_ui(runs, tmp_path):
    """`mlflow ui` on the runs' store, on a free port, in its own process group."""
    from serving import free_port

    port = free_port()
    log = tmp_path / "mlflow_ui.log"
    command = [str(BIN / "mlflow"), "ui", "--backend-store-uri", runs.uri]
    command += ["--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"  # as cluster/tracking_server.sh runs it
    with log.open("w") as output:
        server = subprocess.Popen(
            command, env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_http(f"{url}/health", server, log, "mlflow ui", STARTUP_SECONDS)
        yield url
    finally:
        stop_group(server)


def preview_of(page, timeout: float = 60) -> list | None:
    """mlflow ui's preview of an HTML artifact: a sandboxed frame; its text and whether every
    image in it loaded, once it shows the report."""
    from browser import BODY_TEXT, IMAGES_LOADED

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for found in page.in_frames(f"[{BODY_TEXT}, {IMAGES_LOADED}]"):
            if found and found[0].startswith("Run report"):
                return found
        time.sleep(0.5)
    return None


@needs_chromium
def test_mlflow_ui_lists_every_silo_model_and_the_report(runs, mlflow_ui, tmp_path):
    """The README's walk-through: the registered models page, then the run's artifacts."""
    from browser import chromium

    run_id = Runs.run_id(runs.fedavg)
    query = f"{mlflow_ui}/api/2.0/mlflow/artifacts/list?run_id={run_id}&path=report"
    with urllib.request.urlopen(query, timeout=30) as answer:
        listed = {f["path"] for f in json.loads(answer.read())["files"]}
    assert "report/report.html" in listed
    experiment = MlflowClient(runs.uri).get_run(run_id).info.experiment_id
    names = [f"heart_disease-{hospital}" for hospital in HOSPITALS]
    with chromium() as page:
        page.resize(1280, 900)
        page.open(f"{mlflow_ui}/#/models")
        models_text = page.wait_for_text(names)
        time.sleep(2)  # mlflow ui opens a dialog about its new registry UI; close it
        page.escape()
        time.sleep(1)
        models = page.screenshot(tmp_path / "mlflow_registered_models.png", full_page=False)
        # The run's Artifacts tab, with report/report.html selected: the tree and its preview.
        page.resize(1280, 2000)
        page.open(f"{mlflow_ui}/#/experiments/{experiment}/runs/{run_id}/artifacts/{PAGE}")
        run_text = page.wait_for_text([PAGE])
        preview = preview_of(page)
        run_page = page.screenshot(tmp_path / "mlflow_run_artifacts.png", full_page=False)
    keep_screens(models, run_page)
    missing = [n for n in names if n not in models_text]
    assert not missing, f"not on the registered models page: {missing}: {html.escape(models_text)}"
    assert PAGE in run_text
    assert preview is not None, "mlflow ui shows no preview of report.html"
    assert preview[0].startswith(f"Run report: heart_disease / fedavg / {run_id}")
    assert preview[1] is True, "a figure of the report does not show in mlflow ui's preview"


def _series(name: str, rounds: tuple[int, ...]):
    from silo_pfl.report.data import SiloSeries

    values = tuple(0.5 + 0.05 * r for r in rounds)
    return SiloSeries(name, rounds, values, values, {}, rounds[-1], values[-1], values[-1])


def test_the_accuracy_figure_breaks_a_silos_lines_where_it_missed_rounds_and_titles_within():
    """A silo left out of rounds 2 to 4 has no values there: its lines break, not a straight
    segment from round 1 to 5. With two silos and a long federation name, the title (the
    figure's colour key) stays inside the figure."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from silo_pfl.report.data import RunData
    from silo_pfl.report.figures import accuracy_figure

    silos = {"a": _series("a", (1, 2, 3, 4, 5)), "b": _series("b", (1, 5))}
    run = RunData("r" * 32, "a_federation_with_a_long_name", "fedper", "0", 5, 1.0, False, silos)
    fig = accuracy_figure(run)
    for line in fig.axes[1].lines[:2]:  # validation, test
        assert list(line.get_xdata()) == [1, 2, 3, 4, 5]
        y = np.asarray(line.get_ydata(), dtype=float)
        assert np.isnan(y[1:4]).all() and not np.isnan(y[[0, 4]]).any(), y
    FigureCanvasAgg(fig).draw()
    title = fig._suptitle.get_window_extent(fig.canvas.get_renderer())
    assert title.x0 >= 0 and title.x1 <= fig.bbox.x1 and title.y1 <= fig.bbox.y1, title
    # Beyond 20 rounds too, a point between missed rounds shows: as its dot.
    long = {"a": _series("a", tuple(range(1, 26))), "b": _series("b", (1, 3, 25))}
    fig = accuracy_figure(dataclasses.replace(run, rounds=25, silos=long))
    assert all(line.get_marker() == "." for line in fig.axes[1].lines[:2])


def test_report_refuses_to_compare_with_or_from_a_run_that_did_not_finish(
    runs, unfinished, tmp_path, capsys
):
    """A run interrupted before its silos selected a model has no selected accuracy to draw a
    gain from, either side of --against: one line, exit 2 (before, matplotlib's "Axis limits
    cannot be NaN or Inf", exit 1)."""
    finished = Runs.run_id(runs.fedavg)
    for run_id, against in ((finished, unfinished), (unfinished, finished)):
        out = tmp_path / run_id
        assert main(report(runs, run_id, out, "--against", against, "--no-log")) == 2
        err = capsys.readouterr().err.strip()
        assert err == (
            f"error: --against {against}: run {unfinished} did not finish (KILLED): it has no "
            "selected models to compare"
        ), err
        assert not out.exists()


def test_the_report_of_a_run_that_did_not_finish_shows_no_selected_round(
    runs, unfinished, tmp_path
):
    """Its silos selected no model: the table shows -, not round 0, the figure marks no round,
    and a note says why."""
    from silo_pfl.report.data import read_run
    from silo_pfl.report.figures import accuracy_figure

    out = tmp_path / "out"
    assert main(report(runs, unfinished, out, "--no-log")) == 0
    page = (out / "report.html").read_text()
    for hospital in HOSPITALS:
        row = re.search(rf'<td class="name">{hospital}</td>(.*?)</tr>', page)
        assert row is not None and row.group(1) == "<td>-</td>" * 3, (hospital, row)
    assert "No selection: the run did not finish (KILLED)" in page
    assert "--against OTHER_RUN_ID" not in page
    run = read_run(MlflowClient(runs.uri), unfinished)
    fig = accuracy_figure(run)
    for ax in fig.axes[: len(HOSPITALS)]:
        assert len(ax.lines) == 2, "validation and test only: no selected round marked"
        assert ax.get_title().endswith(": no selection"), ax.get_title()


def test_a_report_that_fails_leaves_the_older_one_as_it_was(runs, tmp_path, monkeypatch):
    """A report drawn over an older one in --out that fails midway (a figure that raises, as a
    crash would) leaves every file of the older one, byte for byte, and no file of its own."""
    from silo_pfl.report import figures

    out = tmp_path / "out"
    run_id, against = Runs.run_id(runs.fedper), Runs.run_id(runs.fedavg)
    assert main(report(runs, run_id, out, "--against", against, "--no-log")) == 0
    before = {path.name: path.read_bytes() for path in out.iterdir()}
    assert {"report.html", "gain.png"} <= set(before)

    def crash(*args: object) -> None:
        raise RuntimeError("the figure failed")

    monkeypatch.setattr(figures, "spread", crash)
    assert main(report(runs, run_id, out, "--no-log")) == 1
    assert {path.name: path.read_bytes() for path in out.iterdir()} == before
    # The page has the permissions of its figures, of any new file here: a tracking server
    # running as another user serves it (written whole through a private temporary file, it was
    # the owner's alone).
    probe = tmp_path / "probe"
    probe.write_text("")
    assert {path.stat().st_mode & 0o777 for path in out.iterdir()} == {probe.stat().st_mode & 0o777}
