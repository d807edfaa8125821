"""Cold start with input it cannot take, for real (local Ray, MLflow in SQLite, hospital CSVs):
an onboarding that fails or is stopped leaves no directory, `--resume` never takes an onboarding
for a federation run, and a seed, data split or federation setting other than the trained run's
is refused in one line before anything starts."""

from __future__ import annotations

import json
import os
import signal
from dataclasses import dataclass
from pathlib import Path

import pytest

from silo_pfl.callbacks import Callback
from silo_pfl.cli import main
from silo_pfl.data.heart_disease import RAW_COLUMNS, read_complete_rows
from silo_pfl.errors import Interrupted
from silo_pfl.federation import Federation
from silo_pfl.results import FederationResult, RoundSummary
from silo_pfl.settings import load_config

NEW = "va"  # the hospital that sits out of training, then joins


@dataclass(frozen=True)
class Trained:
    """A CSV federation of cleveland and hungarian, trained with va sitting out."""

    job: Path
    runs: Path  # <output_dir>/<name>/: each run's directory
    run_id: str  # the federation run's directory


def _write_csv(path: Path, silo: str, drop: int = 0) -> Path:
    """The hospital's first 60 complete rows with the label last, less its first `drop`
    feature columns."""
    features, labels = read_complete_rows(silo)
    header = [*RAW_COLUMNS[drop:], "label"]
    rows = [
        [*(f"{v:g}" for v in row[drop:]), str(int(y))]
        for row, y in zip(features, labels, strict=True)
    ]
    path.write_text("".join(",".join(r) + "\n" for r in [header, *rows[:60]]))
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory, ray_local) -> Trained:
    tmp = tmp_path_factory.mktemp("onboarding_inputs")
    paths = [
        f"    {silo}: {_write_csv(tmp / f'{silo}.csv', silo)}"
        for silo in ("cleveland", "hungarian", NEW)
    ]
    job = tmp / "job.yaml"
    job.write_text(
        "\n".join(
            [
                "name: joining",
                "rounds: 2",
                f"output_dir: {tmp / 'runs'}",
                "data:",
                "  source: csv",
                "  num_classes: 2",
                f"  late_silos: [{NEW}]",
                "  paths:",
                *paths,
                "model: {name: mlp, hidden: [8]}",
                "algorithm: {name: fedper}",
                f"tracking: {{uri: 'sqlite:///{tmp / 'mlflow.db'}'}}",
            ]
        )
    )
    founded = tmp / "founders.json"
    assert main(["run", str(job), "--quiet", "--results", str(founded)]) == 0
    runs = tmp / "runs" / "joining"
    return Trained(job, runs, json.loads(founded.read_text())["run_id"])


def _dirs(trained: Trained) -> set[str]:
    return {path.name for path in trained.runs.iterdir()}


def _one_line(err: str, start: str) -> None:
    assert err.startswith(f"error: {start}") and err.count("\n") == 1, err


class _CtrlC(Callback):
    """Ctrl-C as the first round ends."""

    def on_round_end(self, summary: RoundSummary) -> None:
        raise KeyboardInterrupt


class _SigtermAsItEnds(Callback):
    """`ray job stop` once the onboarding's Ray session has ended, as its results are drawn."""

    def on_end(self, result: FederationResult) -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        signal.sigtimedwait([], 1)  # the handler runs here


def test_a_failed_or_interrupted_onboarding_leaves_no_directory(trained, tmp_path, capsys):
    before = _dirs(trained)
    assert before == {trained.run_id}
    missing = tmp_path / "missing.csv"
    code = main(["onboard", str(trained.job), "--silo", NEW, f"data.paths.{NEW}={missing}"])
    assert code == 1 and str(missing) in capsys.readouterr().err
    assert _dirs(trained) == before, "a silo whose file is missing"
    narrow = _write_csv(tmp_path / "narrow.csv", NEW, drop=1)  # 9 features, not 10
    code = main(["onboard", str(trained.job), "--silo", NEW, f"data.paths.{NEW}={narrow}"])
    _one_line(capsys.readouterr().err, f"silo {NEW}: inputs of shape (9,), but the federation")
    assert code == 1 and _dirs(trained) == before, "data of another shape than the model's"
    swapped = _write_csv(tmp_path / "swapped.csv", NEW)  # its first two columns swapped
    rows = [line.split(",") for line in swapped.read_text().splitlines()]
    swapped.write_text("".join(",".join([r[1], r[0], *r[2:]]) + "\n" for r in rows))
    code = main(["onboard", str(trained.job), "--silo", NEW, f"data.paths.{NEW}={swapped}"])
    _one_line(capsys.readouterr().err, f"silo {NEW}: its data's columns differ from the founders'")
    assert code == 1 and _dirs(trained) == before, "the model's shape, other columns"
    federation = Federation(load_config(trained.job), callbacks=[_CtrlC()])
    with pytest.raises(KeyboardInterrupt):
        federation.onboard(NEW)
    assert _dirs(trained) == before, "Ctrl-C with the baseline beside it"
    # Once its Ray session had ended, SIGTERM ended the process at once, directories and all.
    federation = Federation(load_config(trained.job), callbacks=[_SigtermAsItEnds()])
    with pytest.raises(Interrupted):
        federation.onboard(NEW, alone=False)
    assert _dirs(trained) == before, "SIGTERM as the onboarding's results are drawn"


def test_a_diverged_alone_baseline_is_left_out_and_a_diverged_joining_silo_ends_it(
    trained, tmp_path, capsys, caplog
):
    """No model that is not finite is ever selected. The alone baseline is a comparison only:
    without a model it is left out, with a warning, and the silo joins. The joining silo
    without one ends the onboarding in one line, leaving nothing."""
    results = tmp_path / "joined.json"
    baseline_diverges = ["train.lr=1e35", "train.local_epochs=20", f"output_dir={tmp_path}"]
    joining = ["onboard", str(trained.job), "--silo", NEW, "--quiet", "--results", str(results)]
    code = main([*joining, *baseline_diverges])
    assert code == 0, capsys.readouterr().err
    said = f"silo {NEW}'s alone baseline: its model was not finite in every round it was "
    assert said in caplog.text
    assert "so the silo joined without that comparison; a lower train.lr" in caplog.text
    report = json.loads(results.read_text())["onboard"]
    assert report["alone_none"].startswith(said) and "alone_test_accuracy" not in report
    capsys.readouterr()
    before = _dirs(trained)
    silo_diverges = ["--no-alone", "train.lr=3e38", "train.local_epochs=20"]
    code = main(["onboard", str(trained.job), "--silo", NEW, *silo_diverges])
    err = capsys.readouterr().err
    _one_line(err[err.index("error: ") :], f"silo {NEW}: its personalized model was not finite ")
    assert "lower train.lr or the options of algorithm.fedper" in err
    assert code == 1 and _dirs(trained) == before


def test_resume_takes_the_latest_federation_run_never_an_onboarding(trained, capsys):
    assert main(["onboard", str(trained.job), "--silo", NEW, "rounds=1", "--no-alone"]) == 0
    (onboarded,) = _dirs(trained) - {trained.run_id}
    record = json.loads((trained.runs / onboarded / "run.json").read_text())
    assert record["kind"] == "onboard"
    capsys.readouterr()
    resumed = trained.runs.parent / "resumed.json"
    code = main(
        ["run", str(trained.job), "--resume", "rounds=3", "--quiet", "--results", str(resumed)]
    )
    assert code == 0, capsys.readouterr().err
    assert json.loads(resumed.read_text())["run_id"] == trained.run_id
    capsys.readouterr()
    assert main(["run", str(trained.job), "--resume", onboarded, "rounds=4"]) == 2
    _one_line(capsys.readouterr().err, f"--resume {onboarded}: a silo's onboarding")


@pytest.mark.parametrize(
    ("override", "start"),
    [
        ("seed=1", "seed: got 1, but run "),
        ("data.val_fraction=0.3", "data.val_fraction: got 0.3, but run "),
        ("data.num_classes=3", "data.num_classes: got 3, but run "),
        ("algorithm.name=fedrep", "algorithm.name: got 'fedrep', but run "),
        ("model.hidden=[16]", "model.hidden: got [16], but run "),
        ("model.hidden=[32]", "model.hidden: got [32], but run "),  # written, though the default
        ("split.local=[first:1]", "split.local: got ['first:1'], but run "),
        ("server.lr=0.5", "server.lr: got 0.5, but run "),
    ],
)
def test_onboarding_refuses_a_split_or_federation_setting_other_than_the_trained_runs(
    trained, capsys, override, start
):
    before = _dirs(trained)
    assert main(["onboard", str(trained.job), "--silo", NEW, override]) == 2
    _one_line(capsys.readouterr().err, start)
    assert _dirs(trained) == before


def test_a_run_trained_with_no_central_models_is_named_as_what_stops_a_join(
    trained, tmp_path, capsys
):
    """privacy.central_models=none keeps the global layers out of every store, as promised;
    joining such a run names that setting, not a version of silo-pfl."""
    store = [f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}", f"output_dir={tmp_path}"]
    founded = tmp_path / "founders.json"
    none = [*store, "privacy.central_models=none", "--quiet", "--results", str(founded)]
    assert main(["run", str(trained.job), *none]) == 0
    run_id = json.loads(founded.read_text())["mlflow"]["run_id"]
    capsys.readouterr()
    assert main(["onboard", str(trained.job), "--silo", NEW, *store, "--no-alone"]) == 2
    _one_line(
        capsys.readouterr().err,
        f"onboard: run {run_id} was trained with privacy.central_models=none: its global layers",
    )


def test_a_silo_named_alone_joins_beside_its_alone_baseline(tmp_path):
    """The baseline's role was the name `alone`: a joining silo of that name was overwritten by
    its own baseline, never trained on the federation's layers, and reported the baseline's
    figures as its own, with no baseline."""
    files = {"cleveland": "cleveland", "hungarian": "hungarian", "alone": NEW}
    paths = [f"    {s}: {_write_csv(tmp_path / f'{h}.csv', h)}" for s, h in files.items()]
    job = tmp_path / "job.yaml"
    job.write_text(
        "\n".join(
            [
                "name: lonely",
                "rounds: 2",
                f"output_dir: {tmp_path / 'runs'}",
                "data:",
                "  source: csv",
                "  num_classes: 2",
                "  late_silos: [alone]",
                "  paths:",
                *paths,
                "model: {name: mlp, hidden: [8]}",
                "algorithm: {name: fedper}",
                f"tracking: {{uri: 'sqlite:///{tmp_path / 'mlflow.db'}'}}",
            ]
        )
    )
    assert main(["run", str(job), "--quiet"]) == 0
    joined = tmp_path / "joined.json"
    assert main(["onboard", str(job), "--silo", "alone", "--results", str(joined)]) == 0
    result = json.loads(joined.read_text())
    report = result["onboard"]
    assert list(result["silos"]) == ["alone"] and result["silos"]["alone"]["selected_round"] >= 1
    assert 0 < report["alone_test_accuracy"] <= 1
    assert report["gain_over_alone"] == report["test_accuracy"] - report["alone_test_accuracy"]
