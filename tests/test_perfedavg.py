"""Per-FedAvg (first order) on the plain Silo and Server classes: its FO-MAML step against a hand
computation, its reduction to FedAvg, the adapted personalized model, and its layer-wise variant."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from plain_federation import JOB, federation, play_round, same_updates
from torch import nn

from silo_pfl.algorithms import build_algorithm
from silo_pfl.algorithms.base import Phase
from silo_pfl.errors import ConfigError
from silo_pfl.training import evaluate, train_epochs


def _algorithm(job, *overrides: str):
    cfg = job(JOB, "algorithm.name=perfedavg", *overrides)
    return build_algorithm(cfg.algorithm, cfg.train)


def _grad(w: torch.Tensor, b: torch.Tensor, x: torch.Tensor, y: torch.Tensor):
    """The gradient of the cross-entropy of the linear model (w, b) on one batch."""
    w, b = w.clone().requires_grad_(), b.clone().requires_grad_()
    return torch.autograd.grad(nn.functional.cross_entropy(x @ w.T + b, y), (w, b))


def test_first_order_maml_step_matches_a_hand_computation(job):
    alpha, beta, momentum = 0.3, 0.1, 0.9
    algorithm = _algorithm(
        job,
        f"algorithm.perfedavg.inner_lr={alpha}",
        f"train.lr={beta}",
        f"train.momentum={momentum}",
        "train.optimizer=sgd",
    )
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    batches = [(torch.randn(4, 3), torch.randint(0, 2, (4,))) for _ in range(5)]
    w, b = model.weight.detach().clone(), model.bias.detach().clone()
    optimizer = algorithm.optimizer(list(model.parameters()), Phase("all", 1), "")
    for x, y in batches:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

    # By hand: two meta-steps over batches (1, 2) and (3, 4), outer SGD with momentum.
    buffers = None
    for (x, y), (x2, y2) in (batches[0:2], batches[2:4]):
        gw, gb = _grad(w, b, x, y)
        meta = _grad(w - alpha * gw, b - alpha * gb, x2, y2)
        buffers = (
            meta
            if buffers is None
            else [momentum * m + g for m, g in zip(buffers, meta, strict=True)]
        )
        w, b = w - beta * buffers[0], b - beta * buffers[1]
    # Batch 5 is an inner step with no outer step after it: provisional until finish().
    gw, gb = _grad(w, b, *batches[4])
    torch.testing.assert_close(model.weight.detach(), w - alpha * gw)
    optimizer.finish()
    torch.testing.assert_close(model.weight.detach(), w)
    torch.testing.assert_close(model.bias.detach(), b)


def test_the_shared_loop_ends_a_meta_step_it_started(job):
    """Three full-batch steps in train_epochs: a meta-step, then an inner step it undoes."""
    alpha, beta = 0.5, 0.2
    algorithm = _algorithm(
        job, f"algorithm.perfedavg.inner_lr={alpha}", f"train.lr={beta}", "train.momentum=0"
    )
    torch.manual_seed(1)
    model = nn.Linear(3, 2)
    x, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
    w, b = model.weight.detach().clone(), model.bias.detach().clone()
    optimizer = algorithm.optimizer(list(model.parameters()), Phase("all", 3), "")
    generator = torch.Generator().manual_seed(0)
    train_epochs(model, x, y, epochs=3, batch_size=8, optimizer=optimizer, generator=generator)
    gw, gb = _grad(w, b, x, y)
    mw, mb = _grad(w - alpha * gw, b - alpha * gb, x, y)
    torch.testing.assert_close(model.weight.detach(), w - beta * mw)
    torch.testing.assert_close(model.bias.detach(), b - beta * mb)


@pytest.mark.parametrize("inner_steps", [0, 3])
def test_zero_inner_lr_is_fedavg_exactly(job, inner_steps):
    """inner_lr=0 (with any inner_steps) sends FedAvg's updates and is judged like FedAvg."""
    options = ("algorithm.perfedavg.inner_lr=0", f"algorithm.perfedavg.inner_steps={inner_steps}")
    per, per_server = federation(job, "perfedavg", *options)
    fed, fed_server = federation(job, "fedavg")
    meta, meta_server = federation(job, "perfedavg", "algorithm.perfedavg.inner_lr=0.05")
    for round_ in (1, 2):
        p_updates, p_state, p_evals = play_round(per, per_server, round_)
        f_updates, f_state, f_evals = play_round(fed, fed_server, round_)
        m_updates, _, m_evals = play_round(meta, meta_server, round_)
        assert same_updates(p_updates, f_updates)
        assert all(np.array_equal(p_state[k], f_state[k]) for k in f_state)
        assert [e.val_loss for e in p_evals] == [e.val_loss for e in f_evals]
        assert [e.test_loss for e in p_evals] == [e.test_loss for e in f_evals]
        # A real inner step changes both what is sent and what is judged.
        assert not same_updates(m_updates, f_updates)
        assert [e.val_loss for e in m_evals] != [e.val_loss for e in f_evals]


def test_the_personalized_model_is_one_sgd_step_on_a_copy(job):
    """With one batch holding every training row, the adaptation is w - inner_lr * grad f(w)."""
    alpha = 0.05
    silos, server = federation(
        job,
        "perfedavg",
        "algorithm.perfedavg.inner_steps=1",
        f"algorithm.perfedavg.inner_lr={alpha}",
        "train.batch_size=10000",
    )
    _, state, evals = play_round(silos, server, 1)
    for silo, metrics in zip(silos, evals, strict=True):
        # The silo's own model still holds the round's global state.
        own = silo.model.state_dict()
        assert all(np.array_equal(own[k].numpy(), state[k]) for k in state)
        adapted = silo.algorithm.personalized_model(silo, 1)
        reference = copy.deepcopy(silo.model)
        nn.functional.cross_entropy(reference(silo.train_xy[0]), silo.train_xy[1]).backward()
        for name, param in reference.named_parameters():
            expected = param.detach() - alpha * param.grad
            torch.testing.assert_close(adapted.state_dict()[name], expected)
            assert not torch.equal(expected, param.detach())
        # The silo is judged and served by the adapted copy.
        assert metrics.val_loss == evaluate(adapted, *silo.val_xy).loss
        assert metrics.val_loss != evaluate(silo.model, *silo.val_xy).loss
        silo.commit(1, keep=True)
        kept = torch.load(silo.selected_path)
        assert all(torch.equal(kept[k], v) for k, v in adapted.state_dict().items())


def test_layerwise_adapts_only_the_local_head_and_sends_the_body(job):
    plain, _ = federation(job, "perfedavg")
    assert plain[0].split.local_keys == ()
    silos, server = federation(
        job,
        "perfedavg",
        "algorithm.perfedavg.layerwise=true",
        "algorithm.perfedavg.inner_steps=3",
        "algorithm.perfedavg.inner_lr=0.05",
    )
    local = silos[0].split.local_keys
    assert local and all(k.startswith("head.") for k in local)
    start = {k: v.clone() for k, v in silos[0].model.state_dict().items()}
    updates, _, _ = play_round(silos, server, 1)
    assert all(set(u.delta) == set(silos[0].split.global_keys) for u in updates)
    # Round 1 trained the silo's own head (fast weights) and its body (sent).
    trained = silos[0].model.state_dict()
    assert all(not torch.equal(trained[k], start[k]) for k in local)
    assert any(np.abs(v).sum() > 0 for v in updates[0].delta.values())
    for silo in silos:
        own = silo.model.state_dict()
        adapted = silo.algorithm.personalized_model(silo, 1).state_dict()
        changed = {k for k in own if not torch.equal(own[k], adapted[k])}
        assert changed == set(local)


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["inner_lr=-0.1"], "algorithm.perfedavg.inner_lr"),
        (["inner_steps=-1"], "algorithm.perfedavg.inner_steps"),
        (["layerwise=true", "inner_steps=0"], "algorithm.perfedavg.inner_steps"),
        (["layerwise=true", "inner_lr=0"], "algorithm.perfedavg.inner_lr"),
        (["inner_step=2"], "algorithm.perfedavg.inner_step"),
    ],
)
def test_a_bad_option_is_a_one_line_config_error_naming_it(job, overrides, key):
    with pytest.raises(ConfigError) as error:
        job(JOB, "algorithm.name=perfedavg", *[f"algorithm.perfedavg.{o}" for o in overrides])
    message = str(error.value)
    assert message.startswith(f"{key}:") and "\n" not in message
