"""The heart-disease source reproduces FLamby's split, encoding and normalisation."""

from __future__ import annotations

import json

import numpy as np
import pytest

from silo_pfl.data import heart_disease as hd
from silo_pfl.data.heart_disease_split import build_split
from silo_pfl.errors import DataError

SIZES = {"cleveland": (199, 104), "hungarian": (172, 89), "switzerland": (30, 16), "va": (85, 45)}


def config(val_fraction: float = 0.2) -> hd.Params:
    return hd.Params(source="heart_disease", val_fraction=val_fraction)


def test_shipped_split_equals_sklearn_train_test_split():
    pytest.importorskip("sklearn")
    shipped = json.loads(hd.SPLIT_FILE.read_text())["hospitals"]
    assert shipped == build_split()["hospitals"]


def test_silo_names_are_the_four_hospitals():
    assert hd.silo_names(config()) == ["cleveland", "hungarian", "switzerland", "va"]


@pytest.mark.parametrize("silo", list(SIZES))
def test_flamby_sizes_features_and_dtypes(silo):
    data = hd.load(config(val_fraction=0.0), silo, seed=0)
    assert (len(data.y_train), len(data.y_test)) == SIZES[silo]
    assert data.num_train_total == SIZES[silo][0]
    assert len(data.y_val) == 0
    assert data.input_shape == (13,)
    assert data.x_train.dtype == np.float32 and data.y_train.dtype == np.int64
    assert data.num_classes == 2
    assert set(np.unique(data.y_test)) <= {0, 1}
    assert data.preprocessing.feature_names == hd.FEATURE_NAMES
    assert len(data.preprocessing.mean) == len(data.preprocessing.std) == 13


@pytest.mark.parametrize("silo", list(SIZES))
def test_training_rows_are_normalised(silo):
    x = hd.load(config(val_fraction=0.0), silo, seed=0).x_train.astype(np.float64)
    assert np.allclose(x.mean(axis=0), 0.0, atol=1e-5)
    std = x.std(axis=0, ddof=1)
    varying = std > 0
    assert np.allclose(std[varying], 1.0, atol=1e-5)
    assert np.allclose(x[:, ~varying], 0.0)


def test_raw_rows_encode_and_normalise_like_the_silo():
    data = hd.load(config(), "hungarian", seed=3)
    raw, labels = hd.read_complete_rows("hungarian")
    _, test = hd.flamby_split("hungarian")
    rebuilt = data.preprocessing.apply(hd.encode_raw(raw[test]))
    assert np.allclose(rebuilt, data.x_test, atol=1e-6)
    assert np.array_equal(labels[test], data.y_test)


def test_encode_raw_one_hot_layout():
    row = np.array([[50, 1, 3, 120, 200, 0, 2, 150, 0, 1.5]])
    encoded = hd.encode_raw(row)
    named = dict(zip(hd.FEATURE_NAMES, encoded[0], strict=True))
    assert named["age"] == 50 and named["oldpeak"] == 1.5
    assert (named["cp_2"], named["cp_3"], named["cp_4"]) == (0, 1, 0)
    assert (named["restecg_1"], named["restecg_2"]) == (0, 1)


def test_encode_raw_rejects_unknown_category():
    row = np.array([[50, 1, 7, 120, 200, 0, 2, 150, 0, 1.5]])
    with pytest.raises(DataError, match="column cp has 7") as info:
        hd.encode_raw(row)
    assert "\n" not in str(info.value)


def test_val_is_carved_from_flamby_training_rows():
    full = hd.load(config(val_fraction=0.0), "cleveland", seed=0)
    carved = hd.load(config(val_fraction=0.2), "cleveland", seed=0)
    assert carved.num_train_total == 199
    assert len(carved.y_val) == 40 and len(carved.y_train) == 159
    rows = np.concatenate([carved.x_train, carved.x_val])
    assert np.array_equal(np.unique(rows, axis=0), np.unique(full.x_train, axis=0))
    assert np.array_equal(carved.x_test, full.x_test)
    assert abs(carved.y_val.mean() - full.y_train.mean()) < 0.05


def test_small_hospital_gets_at_least_one_val_row():
    data = hd.load(config(val_fraction=0.01), "switzerland", seed=0)
    assert len(data.y_val) == 1 and len(data.y_train) == 29


def test_deterministic_for_a_seed_and_val_depends_on_it():
    first = hd.load(config(), "va", seed=1)
    again = hd.load(config(), "va", seed=1)
    other = hd.load(config(), "va", seed=2)
    assert np.array_equal(first.x_val, again.x_val)
    assert np.array_equal(first.x_train, again.x_train)
    assert not np.array_equal(first.x_val, other.x_val)
    assert np.array_equal(first.x_test, other.x_test)


def test_unknown_silo_is_a_data_error():
    with pytest.raises(DataError, match="silo lyon: not a heart_disease hospital"):
        hd.load(config(), "lyon", seed=0)
