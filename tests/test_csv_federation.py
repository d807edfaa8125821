"""A CSV federation end to end on a real local Ray with MLflow in SQLite: three silos' files cut
from scikit-learn's breast-cancer data, a few rounds, every silo's model registered as its
champion, and one of them served by a real `mlflow models serve` on raw CSV rows."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from mlflow import MlflowClient
from serving import predict, served
from sklearn.datasets import load_breast_cancer

from silo_pfl import checkpoint
from silo_pfl.data import load_silo_data
from silo_pfl.federation import Federation
from silo_pfl.results import FederationResult
from silo_pfl.run_dir import silo_dir
from silo_pfl.settings import load_config
from silo_pfl.silo import init_model
from silo_pfl.silo_store import SELECTED

pytestmark = pytest.mark.usefixtures("ray_local")

NAME = "breast_cancer"
SILOS = ("clinic_a", "clinic_b", "clinic_c")
LABEL = "diagnosis"  # 0: malignant, 1: benign


@dataclass(frozen=True)
class CsvRun:
    job: Path
    overrides: list[str]
    store: str  # its MLflow tracking and registry URI
    result: FederationResult


def write_silo_files(directory: Path) -> dict[str, Path]:
    """The breast-cancer rows, shuffled once and cut into one file per silo: a header of the 30
    feature names and the label column, then the raw values."""
    data = load_breast_cancer()
    order = np.random.default_rng(0).permutation(len(data.target))
    header = ",".join([*data.feature_names, LABEL])
    paths = {}
    for silo, rows in zip(SILOS, np.array_split(order, len(SILOS)), strict=True):
        lines = [
            ",".join([*(repr(float(v)) for v in data.data[i]), str(int(data.target[i]))])
            for i in rows
        ]
        paths[silo] = directory / f"{silo}.csv"
        paths[silo].write_text("\n".join([header, *lines]) + "\n")
    return paths


def plain_config(paths: dict[str, Path], tmp_path: Path):
    """The heart-disease job's settings over these silos' files, untracked, for plain Silos."""
    return load_config(
        "jobs/heart_disease.yaml",
        [
            f"name={NAME}",
            "data={source: csv, num_classes: 2, label_column: " + LABEL + "}",
            *(f"data.paths.{silo}={path}" for silo, path in paths.items()),
            f"output_dir={tmp_path / 'runs'}",
            "tracking.enabled=false",
        ],
    )


@pytest.fixture(scope="module")
def csv_run(tmp_path_factory, ray_local) -> CsvRun:
    """One tracked CSV federation (FedPer, 3 rounds), shared by this module's tests."""
    root = tmp_path_factory.mktemp("csv_federation")
    paths = write_silo_files(root)
    job = root / "job.yaml"
    job.write_text(
        "\n".join(
            [
                f"name: {NAME}",
                "rounds: 3",
                "seed: 0",
                "data:",
                "  source: csv",
                "  num_classes: 2",
                f"  label_column: {LABEL}",
                "  paths:",
                *(f"    {silo}: {path}" for silo, path in paths.items()),
                "model: {name: mlp, hidden: [16]}",
                "algorithm: {name: fedper}",
                "train: {local_epochs: 2, batch_size: 16, lr: 0.05, momentum: 0.9}",
            ]
        )
        + "\n"
    )
    overrides = [f"output_dir={root / 'runs'}", "tracking.report=false"]
    store = f"sqlite:///{root / 'mlflow.db'}"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_TRACKING_URI", store)  # the default store (tracking.uri unset)
        result = Federation(load_config(job, overrides)).run()
    return CsvRun(job, overrides, store, result)


def test_a_csv_federation_trains_every_silo_well_above_chance_and_registers_each(csv_run):
    result = csv_run.result
    assert result.name == NAME and result.rounds == 3
    assert [h.round for h in result.history] == [1, 2, 3]
    assert all(sorted(h.participants) == list(SILOS) for h in result.history)
    assert sorted(result.silos) == list(SILOS)
    for silo, outcome in result.silos.items():
        assert outcome.num_test >= 40, silo
        # Chance is 0.5, the majority class about 0.63; an MLP on these features gets ~0.95.
        assert outcome.test_accuracy >= 0.85, (silo, outcome.test_accuracy)

    client = MlflowClient(tracking_uri=csv_run.store, registry_uri=csv_run.store)
    registered = sorted(m.name for m in client.search_registered_models())
    assert registered == [f"{NAME}-{silo}" for silo in SILOS]
    for silo, outcome in result.silos.items():
        champion = client.get_model_version_by_alias(f"{NAME}-{silo}", "champion")
        assert champion.status == "READY"
        assert int(champion.tags["round"]) == outcome.selected_round
        assert float(champion.tags["test_accuracy"]) == outcome.test_accuracy
        assert result.extras["mlflow"]["models"][silo] == f"models:/{NAME}-{silo}/1"


def test_a_csv_silos_served_model_predicts_as_its_selected_model_on_raw_rows(csv_run, tmp_path):
    silo = "clinic_b"
    cfg = load_config(csv_run.job, csv_run.overrides)
    data = load_silo_data(cfg.data, silo, cfg.seed)  # the rows the silo held out for test
    assert data.raw_columns == tuple(load_breast_cancer().feature_names)
    outcome = csv_run.result.silos[silo]
    # The silo's selected personalized model as its own directory holds it, run locally.
    state = checkpoint.load(
        silo_dir(cfg, csv_run.result.run_id, silo) / SELECTED, outcome.selected_round
    )
    model = init_model(cfg, data.input_shape, data.num_classes)
    model.load_state_dict(state)
    model.eval()
    with torch.no_grad():
        local = model(torch.from_numpy(data.x_test.astype(np.float32))).argmax(dim=1).numpy()
    assert float(np.mean(local == data.y_test)) == pytest.approx(outcome.test_accuracy)

    model_uri = f"models:/{NAME}-{silo}@champion"
    with served(model_uri, csv_run.store, tmp_path / "serve.log") as url:
        predictions = predict(url, data.raw_columns, data.x_test_raw.tolist())
    assert predictions.shape == data.y_test.shape
    np.testing.assert_array_equal(predictions, local)


@pytest.mark.parametrize("change", ["swapped", "renamed"])
def test_silos_whose_columns_differ_in_name_or_order_are_refused(tmp_path, change):
    """clinic_b's file with two columns swapped (values too), or one renamed: the same shape,
    so before only the count of columns was compared, and the shared layers averaged different
    features. Each silo sends a digest of its column names, never the names."""
    from silo_pfl.config import to_dict
    from silo_pfl.errors import FederationError
    from silo_pfl.messages import model_shape
    from silo_pfl.silo import Silo

    paths = write_silo_files(tmp_path)
    lines = paths["clinic_b"].read_text().splitlines()
    rows = [line.split(",") for line in lines]
    if change == "swapped":
        rows = [[r[1], r[0], *r[2:]] for r in rows]
    else:
        rows[0][0] = "radius of something else"
    paths["clinic_b"].write_text("\n".join(",".join(r) for r in rows) + "\n")
    cfg = plain_config(paths, tmp_path)
    infos = [Silo(to_dict(cfg), silo).setup() for silo in SILOS]
    assert infos[0].columns == infos[2].columns != infos[1].columns
    assert "radius" not in repr(infos[1])
    with pytest.raises(
        FederationError, match="^silo clinic_b: its data's columns differ from silo"
    ):
        model_shape(infos)


def test_a_silo_whose_file_changed_since_its_commit_refuses_to_resume(tmp_path):
    """A silo resumes (or rejoins) only on the rows it committed its rounds on: one value of its
    file changed since, and restoring its checkpoint is refused in one line naming it."""
    from silo_pfl.config import to_dict
    from silo_pfl.errors import FederationError
    from silo_pfl.silo import Silo

    paths = write_silo_files(tmp_path)
    cfg = plain_config(paths, tmp_path)

    def resumed(resume: bool) -> Silo:
        silo = Silo(to_dict(cfg), "clinic_b", "run")
        info = silo.setup(resume=resume)
        silo.build(info.input_shape, 2)
        return silo

    resumed(False)  # commits round 0
    resumed(True).restore(0)  # the same file: restored
    lines = paths["clinic_b"].read_text().splitlines()
    cells = lines[5].split(",")
    cells[0] = repr(float(cells[0]) + 1.0)
    paths["clinic_b"].write_text("\n".join([*lines[:5], ",".join(cells), *lines[6:]]) + "\n")
    with pytest.raises(FederationError, match="^silo clinic_b: its data differ from those it "):
        resumed(True).restore(0)
