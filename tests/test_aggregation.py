"""Aggregation weights, on known numbers; the weighted mean and the step on resnet18-sized
updates: in numpy, without torch, float32 accumulated in float32 (a rounding of the product and
one of the sum per value and update), bit for bit on any number of threads and any block size,
within float32's rounding of the float64 formula, with no temporaries of an update's size."""

import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from silo_pfl import aggregation
from silo_pfl.aggregation import THREADED_VALUES, apply_delta, weighted_mean
from silo_pfl.models import build_model
from silo_pfl.slices import bounds, for_slices


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


def float32_sums(deltas, weights, key):
    """What float32 arithmetic gives: acc = f32(acc + f32(scale32 * delta)), update by update."""
    total = float(sum(weights))
    acc = np.zeros(np.shape(deltas[0][key]), dtype=np.float32)
    for delta, weight in zip(deltas, weights, strict=True):
        acc = acc + np.float32(weight / total) * delta[key]
    return acc


def test_weighted_mean_sums_in_float32_near_the_float64_formula(
    resnet18_updates,
):
    _, updates = resnet18_updates
    weights = [37, 12, 101]
    exact = formula(updates, weights)
    mean = weighted_mean(updates, weights)
    assert set(mean) == set(exact)
    for key, value in exact.items():
        assert mean[key].shape == value.shape
        if updates[0][key].dtype == np.float32:
            assert mean[key].dtype == np.float32
            assert np.array_equal(mean[key], float32_sums(updates, weights, key)), key
            np.testing.assert_allclose(mean[key], value, rtol=1e-6, atol=1e-7)
        else:  # the integer batch counters, in float64
            assert mean[key].dtype == np.float64
            np.testing.assert_allclose(mean[key], value, rtol=1e-15)


@pytest.mark.parametrize("cores", [2, 3])
def test_the_weighted_mean_shared_out_over_cores_is_the_same_bits(
    resnet18_updates, monkeypatch, cores
):
    """The float32 keys, laid end to end, are cut into slices on several threads; each slice is
    worked as the whole."""
    _, updates = resnet18_updates
    weights = [5, 80, 13]
    monkeypatch.setattr(aggregation, "CORES", 1)
    alone = weighted_mean(updates, weights)
    monkeypatch.setattr(aggregation, "CORES", cores)
    shared = sum(v.size for v in updates[0].values() if v.dtype == np.float32)
    assert shared >= THREADED_VALUES, "resnet18's float32 keys are shared out"
    mean = weighted_mean(updates, weights)
    for key, value in alone.items():
        assert np.array_equal(mean[key], value), key


def rounded(deltas, weights, key):
    """`float32_sums` for a float32 key; the float64 formula for any other (float16 included)."""
    if np.asarray(deltas[0][key]).dtype == np.float32:
        return float32_sums(deltas, weights, key)
    return formula([{key: d[key]} for d in deltas], weights)[key]


SHAPES = {"scalar": (), "empty": (0,), "one": (1,), "small": (5000,), "wide": (70, 1000),
          "f64": (3000,), "counter": (), "int32": (7,), "f16": (100,), "none": (0, 3),
          "large": (300, 1001)}  # fmt: skip


def odd_update(rng, silo):
    """Keys of every size and dtype, read-only as Ray's store hands them out; silo 1's "wide" is
    Fortran-ordered."""
    update = {}
    for key, shape in SHAPES.items():
        if key == "counter":
            value = np.full(shape, 3 + silo, dtype=np.int64)
        elif key == "int32":
            value = rng.integers(-5, 5, shape).astype(np.int32)
        elif key == "f64":
            value = rng.normal(size=shape)
        elif key == "f16":
            value = rng.normal(size=shape).astype(np.float16)
        else:
            value = np.asarray(rng.random(shape, dtype=np.float32) - 0.5)
        if key == "wide" and silo == 1:
            value = np.asfortranarray(value)
        value.flags.writeable = False
        update[key] = value
    return update


@pytest.mark.parametrize(
    ("block", "slice_", "threaded", "cores"),
    [(1 << 16, 1 << 16, 1 << 18, 1), (4096, 4096, 8192, 1), (4096, 8192, 8192, 3),
     (1024, 1024, 1, 2), (3000, 6000, 1, 4)],
)  # fmt: skip
def test_keys_of_every_size_and_dtype_across_blocks_and_threads(
    monkeypatch, block, slice_, threaded, cores
):
    """Blocks that span several keys, keys that span several blocks and slices, empty keys and
    scalars, float16, float64 and integers, read-only and non-contiguous inputs: each key is
    its formula, bit for bit in float32, and the inputs are left as they were."""
    rng = np.random.default_rng(1)
    updates = [odd_update(rng, silo) for silo in range(5)]
    before = [{k: v.copy() for k, v in update.items()} for update in updates]
    weights = [3, 0, 7, 11, 2]
    for name, value in [("BLOCK", block), ("SLICE", slice_), ("THREADED_VALUES", threaded),
                        ("CORES", cores)]:  # fmt: skip
        monkeypatch.setattr(aggregation, name, value)
    mean = weighted_mean(updates, weights)
    assert list(mean) == list(SHAPES)
    for key, shape in SHAPES.items():
        expected = rounded(updates, weights, key)
        assert mean[key].shape == shape and mean[key].dtype == expected.dtype, key
        if expected.dtype.itemsize < 8:
            assert mean[key].tobytes() == expected.tobytes(), key
        else:
            np.testing.assert_allclose(mean[key], expected, rtol=1e-15, atol=0)
    for update, copy in zip(updates, before, strict=True):
        for key, value in update.items():
            assert np.array_equal(value, copy[key]), key


def test_importing_the_aggregation_does_not_import_torch():
    """The server aggregates without torch: importing it would cost a second or two at start."""
    code = "import sys, silo_pfl.aggregation; print('torch' in sys.modules)"
    root = Path(aggregation.__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "False", done.stdout + done.stderr


@pytest.mark.parametrize(("size", "parts"), [(1, 4), (10, 3), (3 * 1024 + 5, 2), (8192, 16)])
def test_slices_cover_the_vector_once_in_whole_units(size, parts):
    cuts = bounds(size, 1024, parts)
    assert cuts[0] == 0 and cuts[-1] == size and cuts == sorted(set(cuts))
    assert all(cut % 1024 == 0 for cut in cuts[1:-1]) and len(cuts) - 1 <= parts
    seen = np.zeros(size, dtype=np.int64)

    def mark(first, end):
        seen[first:end] += 1

    for_slices(size, 1024, parts, mark)
    assert (seen == 1).all()
    with pytest.raises(ZeroDivisionError):
        for_slices(size, 1024, parts, lambda first, end: 1 / 0)


def test_weighted_mean_allocates_nothing_of_an_updates_size_but_its_result(resnet18_updates):
    _, updates = resnet18_updates
    largest = max(v.size for v in updates[0].values()) * 8  # twice its largest key
    tracemalloc.start()
    try:
        mean = weighted_mean(updates, [1, 2, 3])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    result = sum(v.nbytes for v in mean.values())
    assert peak - result < largest // 4, (peak, result)


def test_apply_delta_rounds_once_and_allocates_only_its_result(resnet18_updates):
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
        expected = value.astype(np.float64) + delta[key]  # float64 rounds as float32 would
        if np.issubdtype(value.dtype, np.integer):
            expected = np.rint(expected)
        assert out[key].dtype == value.dtype
        assert np.array_equal(out[key], expected.astype(value.dtype)), key
        assert np.array_equal(value, before[key]), key
    result = sum(np.asarray(v).nbytes for v in out.values())
    assert peak - result < max(v.nbytes for v in state.values()), (peak, result)


@pytest.mark.skipif(not hasattr(__import__("resource"), "RUSAGE_THREAD"), reason="Linux only")
def test_the_calling_thread_faults_in_the_mean_before_its_threads_write_it(monkeypatch):
    """The threads write only memory this thread has mapped already: this thread takes a page
    fault for each page of the new vector (at least one per 2 MiB huge page), they take none."""
    import resource

    monkeypatch.setattr(aggregation, "CORES", 2)
    values = 12 << 20  # a 48 MiB vector: a fresh mapping of its own, every time
    deltas = [{"w": np.full(values, float(i), np.float32)} for i in (1, 3)]

    def faults() -> int:
        return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt

    before = faults()
    mean = weighted_mean(deltas, [1, 1])
    assert faults() - before >= mean["w"].nbytes // (2 << 20)
    assert float(mean["w"][0]) == float(mean["w"][-1]) == 2.0
