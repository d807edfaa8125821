"""The global state a silo receives is read where it lies and never written: under Ray it is one
read-only buffer in the object store, shared by every silo of a worker. Plain Silo and Server
classes on real data, the arrays made read-only as Ray hands them out."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from silo_pfl.algorithms import ALGORITHMS
from silo_pfl.config import to_dict
from silo_pfl.data import silo_names
from silo_pfl.federation import Federation
from silo_pfl.server import Server
from silo_pfl.server_start import new_server
from silo_pfl.silo import Silo
from silo_pfl.training import copy_into

JOB = "jobs/digits_label_skew.yaml"
# BatchNorm (fedbn's local keys, integer batch counters among the global keys), few rows.
SMALL = ("model.name=cnn_small_bn", "data.max_train_rows=24", "round.min_silos=2")


def read_only(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Copies of the arrays that numpy refuses to write, as Ray's object store gives them."""
    copies = {}
    for key, value in state.items():
        array = np.array(value)
        array.flags.writeable = False
        copies[key] = array
    return copies


def federation(job, algorithm: str) -> tuple[list[Silo], Server]:
    """Two silos of the digits job under `algorithm`, set up and built, and their server."""
    cfg = job(JOB, f"algorithm.name={algorithm}", *SMALL)
    config = to_dict(cfg)
    silos = [Silo(config, name) for name in silo_names(cfg.data)[:2]]
    infos = [silo.setup() for silo in silos]
    classes = max(info.num_classes for info in infos)
    for silo in silos:
        silo.build(infos[0].input_shape, classes)
    return silos, new_server(config, infos[0].input_shape, classes)


def test_the_silo_keeps_the_received_arrays_in_place_and_copies_them_once_into_its_model(job):
    silos, server = federation(job, "fedavg")
    silo = silos[0]
    received = read_only(server.global_state())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's warning on a read-only array is expected, and
        incoming = silo._load_global(received)  # silenced there alone
    model = silo.model.state_dict()
    for key, array in received.items():
        assert np.shares_memory(incoming[key].numpy(), array), key  # the reference: no copy
        assert not np.shares_memory(model[key].numpy(), array), key  # the model: its own copy
        assert np.array_equal(model[key].numpy(), array), key


def test_a_received_key_the_model_lacks_or_of_another_shape_is_an_error_naming_the_silo(job):
    silos, server = federation(job, "fedavg")
    silo = silos[0]
    key = next(k for k, v in server.global_state().items() if np.asarray(v).ndim == 2)
    model = silo.model
    before = model.state_dict()[key].clone()
    wrong = torch.zeros(before.shape[::-1])
    with pytest.raises(ValueError) as info:
        copy_into(model, {key: wrong}, f"silo {silo.name}")
    assert str(info.value).startswith(f"silo {silo.name}: {key} of shape {tuple(wrong.shape)}")
    assert f"the model has shape {tuple(before.shape)}" in str(info.value)
    with pytest.raises(ValueError, match="body.nothing of shape .*: the model has no such key"):
        copy_into(model, {"body.nothing": torch.zeros(1)}, f"silo {silo.name}")
    assert torch.equal(model.state_dict()[key], before)


def test_copying_into_the_model_sets_parameters_and_integer_buffers_without_tracking_grad(job):
    silos, server = federation(job, "fedavg")
    model = silos[0].model
    state = {k: torch.from_numpy(np.array(v)) for k, v in server.global_state().items()}
    shifted = {k: v + 3 for k, v in state.items()}
    assert any(not v.is_floating_point() for v in shifted.values()), "an integer buffer is covered"
    copy_into(model, shifted, "silo x")
    after = model.state_dict()
    for key, value in shifted.items():
        assert torch.equal(after[key], value), key
    assert all(p.grad_fn is None and p.requires_grad for p in model.parameters())


@pytest.mark.parametrize(
    "algorithm", sorted(a for a, c in ALGORITHMS.items() if not c.__module__.startswith("tests."))
)
def test_no_algorithm_writes_into_the_global_state_or_broadcast_it_received(job, algorithm):
    silos, server = federation(job, algorithm)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for round_ in (1, 2):
            start = read_only(server.global_state())
            broadcast = {name: read_only(v) for name, v in server.broadcast().items()}
            sent = {"start": start, **broadcast}
            kept = {name: {k: v.copy() for k, v in arrays.items()} for name, arrays in sent.items()}
            updates = [silo.fit(start, round_, 1, broadcast)[0] for silo in silos]
            assert server.aggregate(*updates).aggregated
            new = read_only(server.global_state())
            sent["new"], kept["new"] = new, {k: v.copy() for k, v in new.items()}
            for silo in silos:
                silo.evaluate(new, round_)
                silo.commit(round_, keep=True)
            silos[0].adapt(new, round_ + 1)
            for name, arrays in sent.items():
                for key, array in arrays.items():
                    assert np.array_equal(array, kept[name][key]), (round_, name, key)


def _versions(silo: Silo) -> dict[str, int]:
    model = silo.model.state_dict(keep_vars=True)
    return {key: model[key]._version for key in silo.split.global_keys}


def test_the_same_immutable_arrays_received_again_are_not_copied_in_again(job):
    """Under Ray (`inputs_immutable`) the new global state a silo evaluated is what its next fit
    receives, the same object store buffer: the model holds it already. It is copied in again
    once anything wrote into the model's global keys, the arrays are other memory, or the model
    was built again."""
    silos, server = federation(job, "fedavg")
    silo = silos[0]
    silo.inputs_immutable = True
    received = read_only(server.global_state())
    silo._load_global(received)
    loaded = _versions(silo)
    silo._load_global(dict(received))  # the same memory, in another dict: as Ray gives it again
    assert _versions(silo) == loaded
    silo._load_global(read_only(server.global_state()))  # equal values, other memory
    assert all(_versions(silo)[k] > v for k, v in loaded.items())

    key = silo.split.global_keys[0]
    received = read_only(server.global_state())
    silo._load_global(received)
    with torch.no_grad():
        silo.model.state_dict(keep_vars=True)[key].add_(1.0)
    silo._load_global(received)
    assert np.array_equal(silo.model.state_dict()[key].numpy(), received[key])

    writable = {k: np.array(v) for k, v in received.items()}
    silo._load_global(writable)
    loaded = _versions(silo)
    silo._load_global(writable)  # a writable array may have changed in place: copied again
    assert all(_versions(silo)[k] > v for k, v in loaded.items())

    silo._load_global(received)
    silo.build(silo.data.input_shape, silo.num_classes)
    silo._load_global(received)
    assert np.array_equal(silo.model.state_dict()[key].numpy(), received[key])


@pytest.mark.parametrize(
    "algorithm", sorted(a for a, c in ALGORITHMS.items() if not c.__module__.startswith("tests."))
)
def test_skipping_the_copy_changes_no_number(job, algorithm):
    """Each round's new global state, evaluated and then fitted on (the same arrays, as a
    worker receives them), gives the same updates and evaluations whether the silos copy it in
    every time or only when their model does not hold it."""
    runs = []
    for immutable in (False, True):
        silos, server = federation(job, algorithm)
        for silo in silos:
            silo.inputs_immutable = immutable
        seen = []
        state = read_only(server.global_state())
        for round_ in (1, 2, 3):
            broadcast = {name: read_only(v) for name, v in server.broadcast().items()}
            updates = [silo.fit(state, round_, 1, broadcast)[0] for silo in silos]
            seen += [u.delta for u in updates]
            assert server.aggregate(*updates).aggregated
            state = read_only(server.global_state())
            for silo in silos:
                seen.append(silo.evaluate_and_commit(state, round_, round_ - 1 or None))
        runs.append(seen)
    for plain, skipped in zip(*runs, strict=True):
        if isinstance(plain, dict):
            assert plain.keys() == skipped.keys()
            assert all(np.array_equal(plain[k], skipped[k]) for k in plain), algorithm
        else:
            assert plain == skipped, algorithm


@pytest.mark.usefixtures("ray_local")
def test_on_ray_each_fit_after_the_first_starts_from_the_model_its_evaluation_left(tmp_path):
    """Under Ray the new global state a worker's silos evaluate, and then fit on, is one object
    read twice: rounds 2.. copy nothing into the model before training."""
    result = Federation(
        JOB,
        [
            "algorithm.name=count_held_loads",
            "plugins=[tests.load_probe_plugins]",
            "model.name=mlp",
            "model.hidden=[4096]",  # its global state (1.2 MB) goes through the object store
            "data.num_silos=5",
            "rounds=4",
            "eval.selection=last",
            "tracking.enabled=false",
            f"output_dir={tmp_path}",
        ],
    ).run()
    assert {silo.extras["held_loads"] for silo in result.silos.values()} == {3.0}
