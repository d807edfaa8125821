"""train.optimizer, train.lr and train.weight_decay reach a silo's training: a federation's silo
(plain classes, real hospital data) updates exactly as torch.optim's Adam or SGD with the job's
settings would, on the same data from the same weights. tests/test_optim.py checks the classes
themselves against torch.optim."""

from __future__ import annotations

import copy

import pytest
import torch
from plain_federation import federation

# Full batches (cleveland trains on 159 rows), so two epochs are two optimizer steps.
STEPS = ("train.batch_size=1024", "train.local_epochs=2")
LR, DECAY, MOMENTUM = 0.02, 0.01, 0.9  # jobs/heart_disease.yaml sets train.momentum=0.9


def silo_delta(job, optimizer: str) -> tuple[dict[str, torch.Tensor], object, torch.nn.Module]:
    """Cleveland's first FedAvg update with train.optimizer=`optimizer`; the delta, the silo and
    its model as it was before the fit."""
    silos, server = federation(
        job,
        "fedavg",
        f"train.optimizer={optimizer}",
        f"train.lr={LR}",
        f"train.weight_decay={DECAY}",
        *STEPS,
        silos=("cleveland",),
    )
    silo = silos[0]
    initial = copy.deepcopy(silo.model)
    update, _ = silo.fit(server.global_state(), 1)
    assert set(update.delta) == set(initial.state_dict())  # FedAvg: every key is global
    return {k: torch.from_numpy(v) for k, v in update.delta.items()}, silo, initial


def reference_delta(silo, initial: torch.nn.Module, make) -> dict[str, torch.Tensor]:
    """Two full-batch steps of a torch.optim optimizer on the silo's training rows."""
    model = copy.deepcopy(initial)
    optimizer = make(model.parameters())
    x, y = silo.train_xy
    for _ in range(2):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    start, end = initial.state_dict(), model.state_dict()
    return {k: end[k] - start[k] for k in start}


def adam(params):
    return torch.optim.Adam(params, lr=LR, weight_decay=DECAY)


def sgd(params):
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM, weight_decay=DECAY)


def close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-7) for k in a)


@pytest.mark.parametrize(("optimizer", "make", "other"), [("adam", adam, sgd), ("sgd", sgd, adam)])
def test_a_silo_trains_with_the_configured_optimizer_and_lr(job, optimizer, make, other):
    delta, silo, initial = silo_delta(job, optimizer)
    assert silo.cfg.train.optimizer == optimizer
    expected = reference_delta(silo, initial, make)
    for key in delta:
        torch.testing.assert_close(delta[key], expected[key], rtol=1e-4, atol=1e-7)
        assert delta[key].abs().max() > 0, key
    assert not close(delta, reference_delta(silo, initial, other))


def test_adams_update_differs_from_sgds_with_the_same_lr(job):
    adam_delta, _, _ = silo_delta(job, "adam")
    sgd_delta, _, _ = silo_delta(job, "sgd")
    assert not close(adam_delta, sgd_delta)
    # Adam's first steps move every weight with a gradient by about lr, whatever its gradient's
    # scale; SGD's steps scale with the gradient.
    weights = adam_delta["body.fc1.weight"].abs()
    moved = weights[weights > 0]
    assert moved.numel() > 0.5 * weights.numel()
    assert float(moved.median()) == pytest.approx(2 * LR, rel=0.2)
