"""Aggregation weights, on known numbers; the weighted mean and the step on resnet18-sized
updates: the float64 formula bit for bit, with no temporaries of an update's size."""

import tracemalloc

import numpy as np
import pytest

from silo_pfl.aggregation import apply_delta, weighted_mean
from silo_pfl.models import build_model


def test_weighted_mean_on_known_numbers():
    deltas = [{"w": np.array([1.0, 0.0])}, {"w": np.array([4.0, 3.0])}]
    mean = weighted_mean(deltas, [1, 3])
    np.testing.assert_allclose(mean["w"], [(1 * 1 + 3 * 4) / 4, (0 + 3 * 3) / 4])


def test_equal_weights_are_the_plain_mean_and_zero_weight_is_ignored():
    deltas = [{"w": np.array([2.0])}, {"w": np.array([6.0])}, {"w": np.array([100.0])}]
    np.testing.assert_allclose(weighted_mean(deltas, [5, 5, 0])["w"], [4.0])


def test_apply_delta_keeps_dtypes_and_rounds_integer_buffers():
    state = {"w": np.array([1.0], dtype=np.float32), "n": np.array(3, dtype=np.int64)}
    out = apply_delta(state, {"w": np.array([0.5]), "n": np.array(2.4)})
    assert out["w"].dtype == np.float32 and out["w"][0] == pytest.approx(1.5)
    assert out["n"].dtype == np.int64 and int(out["n"]) == 5


@pytest.mark.parametrize("weights", [[0, 0], [-1, 2]])
def test_bad_weights_are_refused(weights):
    with pytest.raises(ValueError, match="weights"):
        weighted_mean([{"w": np.zeros(1)}, {"w": np.zeros(1)}], weights)


@pytest.fixture(scope="module")
def resnet18_updates():
    """Three silos' deltas shaped like resnet18's state (11M values, 122 keys), as they arrive:
    float32 parameters and statistics, int64 batch counters."""
    state = build_model("resnet18", (3, 32, 32), 10).state_dict()
    rng = np.random.default_rng(0)
    updates = [
        {
            key: rng.random(value.shape, dtype=np.float32) - 0.5
            if value.is_floating_point()
            else np.full(value.shape, 3 + silo, dtype=np.int64)
            for key, value in state.items()
        }
        for silo in range(3)
    ]
    return {k: v.numpy() for k, v in state.items()}, updates


def formula(deltas, weights):
    """The reference: sum_i (w_i / sum w) * delta_i in float64, one update after the other."""
    total = float(sum(weights))
    mean = {}
    for key in deltas[0]:
        acc = np.zeros(np.shape(deltas[0][key]), dtype=np.float64)
        for delta, weight in zip(deltas, weights, strict=True):
            acc += (weight / total) * np.asarray(delta[key], dtype=np.float64)
        mean[key] = acc
    return mean


def test_weighted_mean_is_the_float64_formula_bit_for_bit_on_resnet18_updates(resnet18_updates):
    _, updates = resnet18_updates
    weights = [37, 12, 101]
    expected = formula(updates, weights)
    mean = weighted_mean(updates, weights)
    assert set(mean) == set(expected)
    for key, value in expected.items():
        assert mean[key].dtype == np.float64 and mean[key].shape == value.shape
        assert np.array_equal(mean[key], value), key


def test_weighted_mean_allocates_nothing_of_an_updates_size_but_its_result(resnet18_updates):
    _, updates = resnet18_updates
    largest = max(v.size for v in updates[0].values()) * 8  # one float64 key: 19 MB
    tracemalloc.start()
    try:
        mean = weighted_mean(updates, [1, 2, 3])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    result = sum(v.nbytes for v in mean.values())
    assert peak - result < largest // 4, (peak, result)


def test_apply_delta_adds_in_float64_rounds_once_and_allocates_only_its_result(
    resnet18_updates,
):
    state, updates = resnet18_updates
    delta = weighted_mean(updates, [1, 1, 1])
    before = {k: v.copy() for k, v in state.items()}
    tracemalloc.start()
    try:
        out = apply_delta(state, delta)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    for key, value in state.items():
        expected = value.astype(np.float64) + delta[key]
        if np.issubdtype(value.dtype, np.integer):
            expected = np.rint(expected)
        assert out[key].dtype == value.dtype
        assert np.array_equal(out[key], expected.astype(value.dtype)), key
        assert np.array_equal(value, before[key]), key
    result = sum(np.asarray(v).nbytes for v in out.values())
    assert peak - result < max(v.nbytes for v in state.values()), (peak, result)
