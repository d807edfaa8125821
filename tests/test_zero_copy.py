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
