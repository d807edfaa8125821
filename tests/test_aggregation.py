"""Aggregation weights, on known numbers."""

import numpy as np
import pytest

from silo_pfl.aggregation import apply_delta, weighted_mean


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
