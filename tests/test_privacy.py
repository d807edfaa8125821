"""The privacy invariant: nothing a silo hands out holds a local key, and aggregation never
touches a silo's local state. Runs the plain Silo and Server classes (no Ray needed)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from plain_federation import aggregate, fit_all

from silo_pfl import builtin_names
from silo_pfl.config import to_dict
from silo_pfl.messages import SiloUpdate
from silo_pfl.server_start import new_server
from silo_pfl.silo import Silo


def _arrays_and_keys(value, keys: set[str], arrays: list[np.ndarray]) -> None:
    """Collect every dict key, and every array and float (as an array), reachable from a
    returned value."""
    if dataclasses.is_dataclass(value):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        for k, v in value.items():
            keys.add(str(k))
            _arrays_and_keys(v, keys, arrays)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _arrays_and_keys(v, keys, arrays)
    elif isinstance(value, (np.ndarray, torch.Tensor, float, np.floating)):
        arrays.append(np.asarray(value))


DIGITS = ("jobs/digits_feature_shift.yaml", "data.num_silos=2", "model.name=cnn_small_bn")
# Every built-in algorithm, with what it keeps local: its default split where it has one, else
# the head (a K-layer split of a baseline); plus adapters, a BatchNorm model, and masking.
CASES = {
    **{name: ("split.local=[head]",) for name in builtin_names.ALGORITHMS},
    "fedbn": DIGITS,
    "fedper": (),
    "fedrep": (),
    "lg_fedavg": (),
    "local": (),
    "moe_heads": (),
    "apfl": (),
    "ditto": (),
    "fedavg-last2": ("model.hidden=[32,16]", "split.local=[last:2]"),
    "fedper-adapters": ("model.adapter_dim=4", "split.local=[adapters]"),
    "fedper-secure": ("aggregation.secure=true",),
    "ditto-secure": ("aggregation.secure=true",),
}
HOSPITALS = ("cleveland", "hungarian", "switzerland", "va")


@pytest.mark.parametrize("case", sorted(CASES))
def test_nothing_a_silo_hands_out_holds_its_personal_state(job, case):
    """Over two rounds of every algorithm: no local key's name, and no value of a local key, of
    the algorithm's own state (a personal model, alpha, a gate) or of the personalized model
    (where the global state does not hold it), in anything a silo hands out."""
    algorithm, options = case.split("-")[0], CASES[case]
    on_digits = options[:1] == DIGITS[:1]
    path, *options = options if on_digits else ("jobs/heart_disease.yaml", *options)
    secure = "aggregation.secure=true" in options
    names = ("silo_0", "silo_1") if on_digits else HOSPITALS if secure else HOSPITALS[:2]
    quorum = () if secure else (f"round.min_silos={len(names)}",)
    kept = "privacy.central_models=global_only"  # full sends a silo's model, and its figures
    config = to_dict(job(path, f"algorithm.name={algorithm}", kept, *quorum, *options))
    silos = [Silo(config, name) for name in names]
    handed_out = [silo.setup() for silo in silos]
    shape, classes = handed_out[0].input_shape, handed_out[0].num_classes
    keys = {info.silo: info.identity_key for info in handed_out if info.identity_key}
    handed_out += [silo.build(shape, classes, keys) for silo in silos]
    server = new_server(config, shape, classes)
    local_keys = set(silos[0].split.local_keys)
    personal: list[np.ndarray] = []
    for round_ in (1, 2):
        updates = [update for update, _ in fit_all(silos, server, round_, sent=handed_out)]
        local_before = [
            {k: silo.model.state_dict()[k].clone() for k in local_keys} for silo in silos
        ]
        assert aggregate(silos, server, updates, sent=handed_out).aggregated
        global_state = server.global_state()
        for silo, before in zip(silos, local_before, strict=True):
            handed_out.append(silo.evaluate(global_state, round_))
            personal += _personal_values(silo, global_state)
            handed_out.append(silo.commit(round_, keep=True))
            after = silo.model.state_dict()
            for key in local_keys:
                assert torch.equal(after[key], before[key]), f"aggregation changed local {key}"
            for key in silo.split.global_keys:
                np.testing.assert_array_equal(after[key].numpy(), global_state[key])
    handed_out += [silo.outcome() for silo in silos]
    assert local_keys or silos[0].algorithm.local_state(), "the case keeps something personal"
    assert sum(value.size for value in personal) > 0

    found_keys: set[str] = set()
    arrays: list[np.ndarray] = []
    _arrays_and_keys(handed_out, found_keys, arrays)
    assert not found_keys & local_keys
    assert set(global_state).isdisjoint(local_keys)
    telling = [v for v in personal if v.dtype.kind == "f" and np.any(v != np.round(v))]
    for array in arrays:
        for value in telling:
            assert array.shape != value.shape or not np.array_equal(array, value)
    assert not _shared_values(arrays, personal), "a personal value left as a number or a part"


def _personal_values(silo: Silo, global_state: dict[str, np.ndarray]) -> list[np.ndarray]:
    """What of a silo is its own after a round's evaluation: its local keys, its algorithm's
    state (but SCAFFOLD's control variate, which its server mirrors), and the values of its
    personalized model where they differ from the global state."""
    state = silo.model.state_dict()
    values = [state[key].numpy().copy() for key in silo.split.local_keys]
    if not silo.algorithm.server_mirrors_state:
        values += [v.detach().numpy().copy() for v in silo.algorithm.local_state().values()]
    for key, value in silo._evaluated.state_dict().items():
        array = value.detach().numpy()
        if key in global_state:
            array = array[array != global_state[key]]
        values.append(array.copy())
    return values


def _shared_values(arrays: list[np.ndarray], local: list[np.ndarray]) -> list[float]:
    """The values of the local tensors (other than whole numbers, such as a BatchNorm weight's
    initial 1 or a step count) found anywhere in the float arrays and numbers handed out."""
    floats = [a.ravel().astype(np.float64) for a in local if a.dtype.kind == "f"]
    values = np.unique(np.concatenate(floats)) if floats else np.empty(0)
    values = values[values != np.round(values)]
    out = [a.ravel().astype(np.float64) for a in arrays if a.dtype.kind == "f"]
    handed = np.concatenate(out) if out else np.empty(0)
    return sorted(set(handed[np.isin(handed, values)].tolist()))


def test_server_refuses_an_update_with_a_local_key(job):
    cfg = job("jobs/heart_disease.yaml")
    config = to_dict(cfg)
    silo = Silo(config, "hungarian")
    info = silo.setup()
    silo.build(info.input_shape, info.num_classes)
    server = new_server(config, info.input_shape, info.num_classes)
    update, _ = silo.fit(server.global_state(), 1)
    leaked = {**update.delta, "head.weight": np.zeros((2, 32), dtype=np.float32)}
    report = server.aggregate(SiloUpdate("hungarian", 1, update.num_examples, leaked))
    assert "silo hungarian: unexpected keys ['head.weight']" in report.rejected["hungarian"]
    assert not report.aggregated and server.round == 0


@pytest.mark.parametrize(
    ("options", "counted"),
    [
        ((), True),
        (("privacy.central_models=global_only",), False),
        (("privacy.central_models=none",), False),
        (("aggregation.secure=true",), False),
        (("privacy.label_counts=false",), False),
    ],
    ids=["full", "global_only", "none", "secure", "not-wanted"],
)
def test_a_silo_counts_its_rows_per_class_only_for_a_central_store_that_keeps_them(
    job, options, counted
):
    silo = Silo(to_dict(job("jobs/heart_disease.yaml", *options)), "va")
    counts = silo.setup().label_counts
    assert (sum(counts) == len(silo.data.y_train)) if counted else counts == ()
