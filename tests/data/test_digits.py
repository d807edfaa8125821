"""The digits source and the partitioners: shapes, determinism and the promised skews."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from silo_pfl.data import digits, load_silo_data, partitioners, silo_names
from silo_pfl.errors import ConfigError, DataError
from silo_pfl.settings import load_config

ROOT = Path(__file__).resolve().parents[2]


def config(**overrides) -> digits.Params:
    return replace(digits.Params(source="digits"), **overrides)


def load_all(cfg: digits.Params, seed: int = 0) -> list:
    return [digits.load(cfg, silo, seed) for silo in digits.silo_names(cfg)]


def raw(x: np.ndarray) -> np.ndarray:
    """Undo the fixed standardisation: pixels back in [0, 1]."""
    return x * digits.PIXEL_STD + digits.PIXEL_MEAN


def all_labels(data) -> np.ndarray:
    return np.concatenate([data.y_train, data.y_val, data.y_test])


@pytest.fixture(scope="module")
def labels() -> np.ndarray:
    return digits.read_digits()[1]


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"num_silos": 0}, "data.num_silos"),
        ({"num_silos": 129}, "data.num_silos"),
        ({"partition": "random"}, "data.partition"),
        ({"alpha": -1.0}, "data.alpha"),
        ({"alpha": float("inf")}, "data.alpha"),
        ({"classes_per_silo": 0}, "data.classes_per_silo"),
        ({"classes_per_silo": 11}, "data.classes_per_silo"),
        ({"partition": "pathological", "num_silos": 3, "classes_per_silo": 2}, "classes_per_silo"),
        ({"image_shape": [3, 30, 30]}, "data.image_shape"),
        ({"image_shape": [2, 32, 32]}, "data.image_shape"),
        ({"image_shape": [3, 32, 16]}, "data.image_shape"),
        ({"image_shape": [32, 32]}, "data.image_shape"),
    ],
)
def test_validate_names_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key) as info:
        digits.validate(config(**overrides))
    assert "\n" not in str(info.value)


def test_validate_accepts_the_defaults_and_the_largest_federation():
    digits.validate(config())
    digits.validate(config(num_silos=128))


def test_num_silos_out_of_range_says_the_range_in_one_line():
    with pytest.raises(ConfigError) as info:
        digits.validate(config(num_silos=129))
    assert str(info.value) == (
        "data.num_silos: got 129, expected 1 <= value <= 128 (at least 14 of the 1797 digits "
        "per silo)"
    )


def test_128_pathological_silos_each_hold_both_classes_in_every_split():
    cfg = load_config(
        str(ROOT / "jobs" / "digits_label_skew.yaml"),
        ["algorithm.name=fedavg", "data.num_silos=128"],
    )
    assert (cfg.data.partition, cfg.data.classes_per_silo) == ("pathological", 2)
    silos = [load_silo_data(cfg.data, name, cfg.seed) for name in silo_names(cfg.data)]
    assert len(silos) == 128
    for silo in silos:
        classes = np.unique(all_labels(silo))
        assert len(classes) == 2, silo.name
        for split in ("train", "val", "test"):
            held = np.unique(getattr(silo, f"y_{split}"))
            assert np.array_equal(held, classes), (silo.name, split, held)


def test_shapes_ranges_and_sizes():
    cfg = config(num_silos=5, test_fraction=0.25, val_fraction=0.2)
    silos = load_all(cfg)
    assert [s.name for s in silos] == ["silo_0", "silo_1", "silo_2", "silo_3", "silo_4"]
    assert sum(s.num_train_total + len(s.y_test) for s in silos) == 1797
    for s in silos:
        assert s.input_shape == (1, 8, 8)
        assert s.x_train.dtype == np.float32 and s.y_train.dtype == np.int64
        assert raw(s.x_train).min() >= -1e-6 and raw(s.x_train).max() <= 1.0 + 1e-6
        assert s.num_train_total == len(s.y_train) + len(s.y_val)
        assert len(s.y_test) == round(0.25 * (s.num_train_total + len(s.y_test)))
        assert len(s.y_val) == round(0.2 * s.num_train_total)
        assert s.num_classes == 10
        assert s.preprocessing.mean == (digits.PIXEL_MEAN,)


@pytest.mark.parametrize("partition", partitioners.PARTITIONS)
def test_deterministic_for_a_seed(partition):
    cfg = config(partition=partition, num_silos=5)
    first, again = digits.load(cfg, "silo_2", 7), digits.load(cfg, "silo_2", 7)
    for split in ("train", "val", "test"):
        assert np.array_equal(getattr(first, f"x_{split}"), getattr(again, f"x_{split}"))
        assert np.array_equal(getattr(first, f"y_{split}"), getattr(again, f"y_{split}"))


@pytest.mark.parametrize("partition", ["iid", "dirichlet", "pathological"])
def test_partition_covers_disjointly_and_depends_on_the_seed(labels, partition):
    cfg = config(partition=partition, num_silos=10)
    parts = digits.partition(cfg, labels, seed=0)
    assert all(len(part) > 0 for part in parts)
    joined = np.concatenate(parts)
    assert len(np.unique(joined)) == len(joined)
    if partition != "dirichlet":
        assert len(joined) == len(labels)
    other = digits.partition(cfg, labels, seed=1)
    assert any(not np.array_equal(a, b) for a, b in zip(parts, other, strict=True))


def test_val_carve_depends_on_the_seed():
    cfg = config(num_silos=3)
    assert not np.array_equal(
        digits.load(cfg, "silo_0", 0).y_val, digits.load(cfg, "silo_0", 1).y_val
    )


@pytest.mark.parametrize(
    ("num_silos", "k"), [(10, 2), (5, 2), (7, 3), (128, 1), (128, 2), (20, 10), (10, 1)]
)
def test_pathological_gives_each_silo_exactly_k_classes(labels, num_silos, k):
    cfg = config(partition="pathological", num_silos=num_silos, classes_per_silo=k)
    parts = digits.partition(cfg, labels, seed=3)
    assert [len(np.unique(labels[part])) for part in parts] == [k] * num_silos
    sizes = [len(part) for part in parts]
    assert max(sizes) <= 2 * min(sizes) + 2


def test_pathological_silo_data_has_k_classes():
    cfg = config(partition="pathological", num_silos=10, classes_per_silo=2)
    assert all(len(np.unique(all_labels(s))) == 2 for s in load_all(cfg))


def _max_class_share(labels: np.ndarray, parts: list[np.ndarray]) -> float:
    return float(np.mean([np.bincount(labels[p], minlength=10).max() / len(p) for p in parts]))


def test_dirichlet_skew_grows_as_alpha_shrinks(labels):
    def skew(alpha: float) -> float:
        cfg = config(partition="dirichlet", num_silos=10, alpha=alpha)
        return np.mean(
            [_max_class_share(labels, digits.partition(cfg, labels, s)) for s in range(3)]
        )

    assert skew(0.1) > skew(1.0) > skew(100.0)
    assert skew(100.0) < 0.2


def test_dirichlet_every_silo_has_rows(labels):
    cfg = config(partition="dirichlet", num_silos=30, alpha=0.1)
    assert min(len(p) for p in digits.partition(cfg, labels, seed=0)) >= 10


def test_dirichlet_impossible_skew_is_a_config_error(labels):
    cfg = config(partition="dirichlet", num_silos=89, alpha=0.01)
    with pytest.raises(ConfigError, match=r"data\.alpha") as info:
        digits.partition(cfg, labels, seed=0)
    assert "\n" not in str(info.value)


def test_concept_shift_relabels_every_split_with_distinct_permutations():
    plain, shifted = (
        load_all(config(num_silos=6)),
        load_all(config(partition="concept_shift", num_silos=6)),
    )
    perms = digits.label_permutations(config(partition="concept_shift", num_silos=6), seed=0)
    assert len({tuple(p) for p in perms}) == 6
    for index, (p, s) in enumerate(zip(plain, shifted, strict=True)):
        assert np.array_equal(p.x_test, s.x_test)
        for split in ("train", "val", "test"):
            true, seen = getattr(p, f"y_{split}"), getattr(s, f"y_{split}")
            assert np.array_equal(perms[index][true], seen)


def test_concept_shift_same_image_gets_different_labels_at_different_silos(labels):
    perms = digits.label_permutations(config(partition="concept_shift", num_silos=10), seed=0)
    for a in range(10):
        for b in range(a + 1, 10):
            assert (perms[a][labels] != perms[b][labels]).any()


def test_feature_shift_transforms_differ_per_silo_and_keep_labels():
    cfg = config(partition="feature_shift", num_silos=5)
    plain, shifted = load_all(config(num_silos=5)), load_all(cfg)
    shifts = [digits.feature_shift(0, f"silo_{i}") for i in range(5)]
    assert len(set(shifts)) == 5
    assert all(s.geometry in digits.GEOMETRIES for s in shifts)
    for p, s in zip(plain, shifted, strict=True):
        assert np.array_equal(p.y_train, s.y_train)
        assert not np.allclose(p.x_train, s.x_train)
        assert raw(s.x_train).min() >= -1e-6 and raw(s.x_train).max() <= 1.0 + 1e-6
    first = shifted[0].x_train[0]
    assert not np.allclose(first, digits.load(cfg, "silo_0", seed=1).x_train[0])


def test_feature_shift_geometry_is_applied():
    images = np.arange(64, dtype=np.float32).reshape(1, 1, 8, 8) / 64
    shift = digits.FeatureShift(contrast=1.0, brightness=0.0, noise_std=0.0, geometry="rot90")
    out = digits.apply_feature_shift(images, shift, np.random.default_rng(0))
    assert np.allclose(out[0, 0], np.rot90(images[0, 0]))


def test_image_shape_repeats_each_pixel_and_the_grey_and_keeps_rows_splits_and_serving():
    small = digits.load(config(num_silos=4, partition="feature_shift"), "silo_2", 0)
    cfg = config(num_silos=4, partition="feature_shift", image_shape=[3, 32, 32])
    digits.validate(cfg)
    large = digits.load(cfg, "silo_2", 0)
    assert large.input_shape == (3, 32, 32) and large.x_train.dtype == np.float32
    assert np.array_equal(large.y_train, small.y_train)
    assert np.array_equal(large.y_test, small.y_test)
    for channel in range(3):
        for dy, dx in ((0, 0), (3, 1), (2, 3)):
            assert np.array_equal(large.x_train[:, channel, dy::4, dx::4], small.x_train[:, 0])
    # A served model answers on the large images' raw pixels, exactly as the silo trained.
    assert len(large.raw_columns) == 3 * 32 * 32 and large.raw_columns[-1] == "pixel_3071"
    rebuilt = large.preprocessing.apply(digits.encode_raw(large.x_test_raw))
    assert np.array_equal(rebuilt, large.x_test)
    assert digits.encode_raw(small.x_test_raw).shape == (len(small.y_test), 1, 8, 8)
    with pytest.raises(DataError, match="digits raw rows"):
        digits.encode_raw(np.zeros((2, 100)))


def test_unknown_silo_is_a_data_error():
    with pytest.raises(DataError, match="silo silo_12: not a digits silo"):
        digits.load(config(num_silos=3), "silo_12", 0)


def test_missing_scikit_learn_is_a_data_error(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(DataError, match=r"silo silo_0: .*digits\.csv\.gz.*scikit-learn") as info:
        digits.load(config(), "silo_0", 0)
    assert "\n" not in str(info.value)


def test_silos_load_without_importing_sklearn():
    code = (
        "import sys\n"
        "from silo_pfl.data import digits, heart_disease\n"
        "digits.load(digits.Params(source='digits', partition='feature_shift'), 'silo_1', 0)\n"
        "heart_disease.load(heart_disease.Params(source='heart_disease'), 'va', 0)\n"
        "assert 'sklearn' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_holdout_sizes_and_stratification():
    rng = np.random.default_rng(0)
    labels = np.repeat([0, 1, 2], [50, 30, 20])
    kept, held = partitioners.holdout(labels, 0.2, rng)
    assert len(held) == 20 and len(kept) == 80
    assert np.array_equal(np.sort(np.concatenate([kept, held])), np.arange(100))
    assert np.bincount(labels[held]).tolist() == [10, 6, 4]
    assert partitioners.holdout_size(2, 0.01) == 1
    assert partitioners.holdout_size(1, 0.5) == 0
    assert partitioners.holdout_size(10, 0.0) == 0
    assert partitioners.holdout_size(3, 0.99) == 2


def test_iid_parts_are_balanced(labels):
    parts = partitioners.iid(labels, 7, np.random.default_rng(0))
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_a_class_no_open_silo_drew_goes_only_to_silos_under_their_share():
    """At tiny alpha every open silo may draw exactly 0 of a class: the class was then spread
    over every silo, full ones included, against the balancing rule. Four classes of 60 rows
    over four silos now give each silo one class."""
    labels = np.repeat(np.arange(4), 60)
    parts = partitioners.dirichlet(labels, 4, 1e-3, np.random.default_rng(0))
    assert sorted(len(np.unique(labels[part])) for part in parts) == [1, 1, 1, 1]


def test_a_dirichlet_partition_the_seed_cannot_make_is_refused_as_the_config_loads():
    """It was found by the silos, once Ray and every one of them had started (82 s for 128)."""
    overrides = ["data.num_silos=89", "data.alpha=0.01"]
    with pytest.raises(ConfigError, match=r"^data\.alpha: 0\.01 with data\.num_silos=89"):
        load_config("jobs/digits_dirichlet.yaml", overrides)
