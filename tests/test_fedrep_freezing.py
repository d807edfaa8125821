"""FedRep's two phases on the plain Silo and Server classes (real data): the head epochs train
the local keys with the global ones (the body) frozen, then the body epochs train the global
keys with the local ones (the head) frozen. Each phase is observed alone by setting the other's
epochs to 0, and together by comparing with the head phase alone. On a body with BatchNorm its
running statistics stay frozen with its parameters."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from plain_federation import federation

from silo_pfl.silo import Silo

SPLITS = {
    # The default: the head is local, the body global.
    "head": (),
    # Two hidden layers, the last two blocks local: body.fc2 trains with the head.
    "last2": ("model.hidden=[16,8]", "split.local=[last:2]"),
}
LOCAL = {
    "head": {"head.weight", "head.bias"},
    "last2": {"body.fc2.weight", "body.fc2.bias", "head.weight", "head.bias"},
}
# A body with BatchNorm: FedBN's CNN on feature-shifted digits, one silo of four.
BATCHNORM = ("model.name=cnn_small_bn", "data.num_silos=4")
DIGITS = {"path": "jobs/digits_feature_shift.yaml", "silos": ("silo_0",)}
HEART = {"silos": ("cleveland",)}


def fit_one_round(job, head_epochs: int, body_epochs: int, *overrides: str, where=HEART):
    """A silo's first FedRep fit; the silo, its state before and after, and its update. A phase
    of 0 epochs, which a config refuses (it leaves that part untrained for good), isolates the
    other phase here."""
    silos, server = federation(job, "fedrep", *overrides, **where)
    silo: Silo = silos[0]
    silo.algorithm.params = dataclasses.replace(
        silo.algorithm.params, head_epochs=head_epochs, body_epochs=body_epochs
    )
    before = {k: v.clone() for k, v in silo.model.state_dict().items()}
    update, metrics = silo.fit(server.global_state(), 1)
    assert update is not None and np.isfinite(metrics.train_loss)
    after = {k: v.clone() for k, v in silo.model.state_dict().items()}
    return silo, before, after, update


def unchanged(before, after, keys) -> list[str]:
    return [k for k in keys if torch.equal(before[k], after[k])]


def parameters(silo: Silo, keys) -> list[str]:
    names = {name for name, _ in silo.model.named_parameters()}
    return [k for k in keys if k in names]


@pytest.mark.parametrize("split", SPLITS)
def test_the_head_epochs_leave_the_body_bit_identical(job, split):
    silo, before, after, update = fit_one_round(job, 2, 0, *SPLITS[split])
    local, global_ = silo.split.local_keys, silo.split.global_keys
    assert set(local) == LOCAL[split] and global_
    assert unchanged(before, after, global_) == list(global_)
    assert all(not delta.any() for delta in update.delta.values())
    assert unchanged(before, after, local) == []  # every local key trained


@pytest.mark.parametrize("split", SPLITS)
def test_the_body_epochs_leave_the_head_bit_identical(job, split):
    silo, before, after, update = fit_one_round(job, 0, 2, *SPLITS[split])
    local, global_ = silo.split.local_keys, silo.split.global_keys
    assert unchanged(before, after, local) == list(local)
    assert unchanged(before, after, global_) == []  # every global key trained
    assert all(delta.any() for delta in update.delta.values())


def test_in_a_full_fit_the_body_epochs_do_not_move_the_head_the_head_epochs_trained(job):
    """Both phases: the head ends exactly where the head epochs alone leave it (the body
    epochs froze it), and the body still trained."""
    silo, before, both, _ = fit_one_round(job, 2, 1)
    _, _, head_only, _ = fit_one_round(job, 2, 0)
    local, global_ = silo.split.local_keys, silo.split.global_keys
    assert all(torch.equal(both[k], head_only[k]) for k in local)
    assert unchanged(before, both, local) == []
    assert unchanged(head_only, both, global_) == []


def test_the_head_epochs_leave_a_batchnorm_bodys_parameters_bit_identical(job):
    silo, before, after, _ = fit_one_round(job, 1, 0, *BATCHNORM, where=DIGITS)
    body = parameters(silo, silo.split.global_keys)
    assert any(".bn" in k for k in body) and any(".conv" in k for k in body)
    assert unchanged(before, after, body) == body
    assert unchanged(before, after, parameters(silo, silo.split.local_keys)) == []


def test_the_head_epochs_leave_a_batchnorm_bodys_statistics_bit_identical(job):
    silo, before, after, update = fit_one_round(job, 1, 0, *BATCHNORM, where=DIGITS)
    buffers = [k for k in silo.split.global_keys if k not in parameters(silo, [k])]
    assert any(k.endswith("running_mean") for k in buffers)
    moved = [k for k in buffers if k not in unchanged(before, after, buffers)]
    sent = [k for k in buffers if update.delta[k].any()]
    assert (moved, sent) == ([], [])
