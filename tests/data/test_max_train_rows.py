"""data.max_train_rows: a capped silo's preprocessing is fitted on the rows it keeps, and an
uncapped silo's arrays are those of a fit on every training row, as before the cap moved."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from silo_pfl.data import csv_source, digits, load_silo_data
from silo_pfl.data import heart_disease as hd
from silo_pfl.data.base import Preprocessing, assemble, fit_preprocessing
from silo_pfl.data.partitioners import holdout
from silo_pfl.seeding import numpy_rng

HEART = "jobs/heart_disease.yaml"
SKEW = "jobs/digits_label_skew.yaml"
CAP = 10


def _csv_job(tmp_path: Path) -> Path:
    """A CSV job of one silo, `clinic`, with 60 rows of two features on very different scales."""
    rng = np.random.default_rng(7)
    lines = ["height,label,income"]
    lines += [f"{rng.normal(170, 10):.3f},{i % 3},{rng.lognormal(10, 1):.2f}" for i in range(60)]
    table = tmp_path / "clinic.csv"
    table.write_text("\n".join(lines) + "\n")
    job = tmp_path / "csv_job.yaml"
    job.write_text(
        "name: capped\nrounds: 1\ndata:\n  source: csv\n  num_classes: 3\n  paths:\n"
        f"    clinic: {table}\nmodel: {{name: mlp, hidden: [8]}}\nalgorithm: {{name: fedavg}}\n"
    )
    return job


def _raw_rows(cfg, silo: str, seed: int):
    """The silo's encoded rows before normalisation, labels, train/test indices, feature names
    and the std's ddof, read as its source reads them."""
    if cfg.source == "heart_disease":
        raw, labels = hd.read_complete_rows(silo)
        train, test = hd.flamby_split(silo)
        return hd.encode_raw(raw), labels, train, test, hd.FEATURE_NAMES, 1
    names, x, y = csv_source.read_silo_csv(
        silo, Path(cfg.paths[silo]), cfg.label_column, cfg.num_classes
    )
    train, test = holdout(y, cfg.test_fraction, numpy_rng(seed, "test", silo))
    return x, y, train, test, names, 0


SILOS = [("heart_disease", silo) for silo in hd.SILOS] + [("csv", "clinic")]


def _data_cfg(job, tmp_path: Path, source: str, *overrides: str):
    path = HEART if source == "heart_disease" else str(_csv_job(tmp_path))
    return job(path, "tracking.enabled=false", *overrides).data


@pytest.mark.parametrize("seed", [0, 3])
@pytest.mark.parametrize(("source", "silo"), SILOS)
def test_a_capped_silo_is_normalised_on_its_kept_training_and_validation_rows(
    job, tmp_path, source, silo, seed
):
    cfg = _data_cfg(job, tmp_path, source, f"data.max_train_rows={CAP}")
    x, y, train, test, names, ddof = _raw_rows(cfg, silo, seed)
    fit, val = holdout(y[train], cfg.val_fraction, numpy_rng(seed, "val", silo))
    keep = np.sort(numpy_rng(seed, "max_train_rows", silo).choice(len(fit), CAP, False))
    kept_and_val = train[np.sort(np.concatenate([fit[keep], val]))]
    expected = fit_preprocessing(names, x[kept_and_val], ddof=ddof)

    data = load_silo_data(cfg, silo, seed)
    assert len(data.y_train) == CAP and data.num_train_total == CAP + len(val)
    assert data.preprocessing.mean == expected.mean
    assert data.preprocessing.std == expected.std
    uncapped = load_silo_data(_data_cfg(job, tmp_path, source), silo, seed)
    assert data.preprocessing != uncapped.preprocessing
    assert np.array_equal(data.x_train, expected.apply(x[train][fit[keep]]))
    assert np.array_equal(data.x_val, expected.apply(x[train][val]))
    assert np.array_equal(data.x_test, expected.apply(x[test]))
    seen = np.concatenate([data.x_train, data.x_val]).astype(np.float64)
    varies = np.asarray(expected.std) != 1.0
    assert np.allclose(seen.mean(axis=0), 0.0, atol=1e-5)
    assert np.allclose(seen.std(axis=0, ddof=ddof)[varies], 1.0, atol=1e-5)


@pytest.mark.parametrize("seed", [0, 3])
@pytest.mark.parametrize(("source", "silo"), SILOS)
def test_without_a_cap_every_training_row_is_fitted_as_before(job, tmp_path, source, silo, seed):
    cfg = _data_cfg(job, tmp_path, source)
    x, y, train, test, names, ddof = _raw_rows(cfg, silo, seed)
    expected = fit_preprocessing(names, x[train], ddof=ddof)
    normalised = expected.apply(x)
    fit, val = holdout(y[train], cfg.val_fraction, numpy_rng(seed, "val", silo))
    data = load_silo_data(cfg, silo, seed)
    assert data.preprocessing == expected
    assert data.num_train_total == len(train)
    for got, want in (
        (data.x_train, normalised[train][fit]),
        (data.x_val, normalised[train][val]),
        (data.x_test, normalised[test]),
    ):
        assert got.dtype == want.dtype and np.array_equal(got, want)


def test_digits_fixed_standardisation_is_unchanged_with_or_without_a_cap(job):
    cfg = job(SKEW, "tracking.enabled=false").data
    images, labels = digits.read_digits()
    rows = digits.partition(cfg, labels, 0)[2]
    x, digit = images[rows], labels[rows]
    train, test = holdout(digit, cfg.test_fraction, numpy_rng(0, "test", "silo_2"))
    fit, val = holdout(digit[train], cfg.val_fraction, numpy_rng(0, "val", "silo_2"))
    normalised = Preprocessing(mean=(digits.PIXEL_MEAN,), std=(digits.PIXEL_STD,)).apply(x)
    data = load_silo_data(cfg, "silo_2", 0)
    assert np.array_equal(data.x_train, normalised[train][fit])
    assert np.array_equal(data.x_val, normalised[train][val])
    assert np.array_equal(data.x_test, normalised[test])
    capped = load_silo_data(job(SKEW, "data.max_train_rows=50").data, "silo_2", 0)
    assert capped.preprocessing == data.preprocessing
    keep = np.sort(numpy_rng(0, "max_train_rows", "silo_2").choice(len(fit), 50, False))
    assert np.array_equal(capped.x_train, data.x_train[keep])


def test_assemble_fits_on_no_test_row_nor_dropped_training_row():
    ids = np.arange(40, dtype=np.float64)[:, None]  # each row's one feature is its own index
    y, train, test = np.arange(40) % 2, np.arange(30), np.arange(30, 40)
    fitted_on: list[np.ndarray] = []

    def record(rows: np.ndarray) -> Preprocessing:
        fitted_on.append(rows[:, 0].copy())
        return Preprocessing()

    data = assemble(
        "clinic", ids, y, train, test, 0.2, 0, preprocessing=record, max_train_rows=8, num_classes=2
    )
    kept, held = data.x_train[:, 0], data.x_val[:, 0]
    assert len(kept) == 8 and len(held) == 6 and data.num_train_total == 14
    assert np.array_equal(fitted_on[0], np.sort(np.concatenate([kept, held])))
    assert not set(fitted_on[0]) & set(data.x_test[:, 0])
