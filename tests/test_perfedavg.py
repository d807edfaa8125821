"""Per-FedAvg on the plain Silo and Server classes: its FO-MAML and Hessian-free steps against
hand computations, its reduction to FedAvg, the adapted personalized model, and its layer-wise
variant."""

from __future__ import annotations

import copy
import re

import numpy as np
import pytest
import torch
from plain_federation import JOB, federation, play_round, same_updates
from torch import nn

from silo_pfl.algorithms import build_algorithm
from silo_pfl.algorithms.base import Phase
from silo_pfl.errors import ConfigError, FederationError
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


def _closure(model: nn.Module, optimizer, x: torch.Tensor, y: torch.Tensor):
    """The loop's closure, by hand: the batch's loss and gradients at the model's parameters."""

    def again() -> torch.Tensor:
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss

    return again


def test_hessian_free_maml_step_matches_a_hand_computation(job):
    """Per-FedAvg (HF), Fallah et al. (2020): over batches D, D', D'', w' = w - a grad f(w; D),
    v = grad f(w'; D'), and the outer step follows v - a (grad f(w + d v; D'') - grad f(w - d v;
    D'')) / 2d; a meta-step left unfinished is undone."""
    alpha, beta, momentum, delta = 0.3, 0.1, 0.9, 0.01
    algorithm = _algorithm(
        job,
        f"algorithm.perfedavg.inner_lr={alpha}",
        "algorithm.perfedavg.variant=hf",
        f"algorithm.perfedavg.hf_delta={delta}",
        f"train.lr={beta}",
        f"train.momentum={momentum}",
    )
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    batches = [(torch.randn(4, 3), torch.randint(0, 2, (4,))) for _ in range(8)]
    w, b = model.weight.detach().clone(), model.bias.detach().clone()
    optimizer = algorithm.optimizer(list(model.parameters()), Phase("all", 1), "")
    for x, y in batches:
        _closure(model, optimizer, x, y)()
        optimizer.step(_closure(model, optimizer, x, y))

    buffers = None
    for (x, y), (x2, y2), (x3, y3) in (batches[0:3], batches[3:6]):
        gw, gb = _grad(w, b, x, y)
        vw, vb = _grad(w - alpha * gw, b - alpha * gb, x2, y2)
        pw, pb = _grad(w + delta * vw, b + delta * vb, x3, y3)
        mw, mb = _grad(w - delta * vw, b - delta * vb, x3, y3)
        meta = (vw - alpha * (pw - mw) / (2 * delta), vb - alpha * (pb - mb) / (2 * delta))
        buffers = (
            meta
            if buffers is None
            else [momentum * m + g for m, g in zip(buffers, meta, strict=True)]
        )
        w, b = w - beta * buffers[0], b - beta * buffers[1]
    # Batches 7 and 8 began a third meta-step: after D' the parameters are back at w.
    torch.testing.assert_close(model.weight.detach(), w)
    optimizer.finish()
    torch.testing.assert_close(model.weight.detach(), w)
    torch.testing.assert_close(model.bias.detach(), b)
    assert optimizer.saved is None and optimizer.v is None


def test_hessian_free_maml_follows_the_second_order_maml_gradient(job):
    """In float64, HF's meta-gradient is MAML's own, (I - a H(w; D'')) grad f(w'; D'), with the
    Hessian-vector product from autograd, within the central difference's error; first-order
    MAML's is grad f(w'; D') alone, which is not."""
    alpha, delta = 0.5, 1e-4
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    batches = [(torch.randn(16, 4).double(), torch.randint(0, 3, (16,))) for _ in range(3)]
    start = [p.detach().clone() for p in model.parameters()]

    def loss_at(flat: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        params, at = {}, 0
        for name, p in model.named_parameters():
            params[name] = flat[at : at + p.numel()].view_as(p)
            at += p.numel()
        logits = torch.func.functional_call(model, params, (x,))
        return nn.functional.cross_entropy(logits, y)

    w = torch.cat([p.reshape(-1) for p in start])
    g = torch.autograd.functional.jacobian(lambda f: loss_at(f, *batches[0]), w)
    v = torch.autograd.functional.jacobian(lambda f: loss_at(f, *batches[1]), w - alpha * g)
    hvp = torch.autograd.functional.hvp(lambda f: loss_at(f, *batches[2]), w, v)[1]
    maml = v - alpha * hvp

    algorithm = _algorithm(
        job,
        f"algorithm.perfedavg.inner_lr={alpha}",
        "algorithm.perfedavg.variant=hf",
        f"algorithm.perfedavg.hf_delta={delta}",
        "train.lr=1",
        "train.momentum=0",
    )
    optimizer = algorithm.optimizer(list(model.parameters()), Phase("all", 1), "")
    for x, y in batches:
        _closure(model, optimizer, x, y)()
        optimizer.step(_closure(model, optimizer, x, y))
    moved = w - torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    torch.testing.assert_close(moved, maml, rtol=1e-6, atol=1e-8)
    assert float((maml - v).norm()) > 1e-3 * float(maml.norm())  # the Hessian's term counts


def test_the_loops_closure_leaves_batchnorm_statistics_to_the_steps_own_pass(job):
    """Three steps of Per-FedAvg (HF) in train_epochs: the closure's two passes on D'' train the
    Hessian-vector product but do not count as batches BatchNorm has seen."""
    algorithm = _algorithm(
        job, "algorithm.perfedavg.inner_lr=0.1", "algorithm.perfedavg.variant=hf"
    )
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    x, y = torch.randn(24, 3), torch.randint(0, 2, (24,))
    optimizer = algorithm.optimizer(list(model.parameters()), Phase("all", 1), "")
    generator = torch.Generator().manual_seed(0)
    start = copy.deepcopy(model)
    train_epochs(model, x, y, epochs=1, batch_size=8, optimizer=optimizer, generator=generator)
    assert int(model[1].num_batches_tracked) == 3
    # The statistics are those of the steps' own passes: at w, w' and w, on D, D' and D''.
    order = torch.randperm(24, generator=torch.Generator().manual_seed(0))
    seen = [x[order[i : i + 8]] for i in (0, 8, 16)]
    inner = copy.deepcopy(start)
    nn.functional.cross_entropy(inner(seen[0]), y[order[0:8]]).backward()
    with torch.no_grad():
        for p in inner.parameters():
            p -= 0.1 * p.grad
        passes = [start[:1](seen[0]), inner[:1](seen[1]), start[:1](seen[2])]
    mean = torch.zeros(4)
    for hidden in passes:
        mean = 0.9 * mean + 0.1 * hidden.mean(dim=0)
    torch.testing.assert_close(model[1].running_mean, mean)


def test_hessian_free_per_fedavg_trains_differently_and_the_same_twice(job):
    options = ("algorithm.perfedavg.inner_lr=0.05",)
    hf, hf_server = federation(job, "perfedavg", *options, "algorithm.perfedavg.variant=hf")
    again, again_server = federation(job, "perfedavg", *options, "algorithm.perfedavg.variant=hf")
    fo, fo_server = federation(job, "perfedavg", *options)
    for round_ in (1, 2):
        h_updates, _, h_evals = play_round(hf, hf_server, round_, commit=True)
        a_updates, _, a_evals = play_round(again, again_server, round_, commit=True)
        f_updates = play_round(fo, fo_server, round_, commit=True)[0]
        assert same_updates(h_updates, a_updates)
        assert [e.val_loss for e in h_evals] == [e.val_loss for e in a_evals]
        assert not same_updates(h_updates, f_updates)
        assert all(np.isfinite(v).all() for u in h_updates for v in u.delta.values())


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
        (["variant=so"], "algorithm.perfedavg.variant"),
        (["variant=hf", "hf_delta=0"], "algorithm.perfedavg.hf_delta"),
        (["layerwise=true", "variant=hf"], "algorithm.perfedavg.variant"),
    ],
)
def test_a_bad_option_is_a_one_line_config_error_naming_it(job, overrides, key):
    with pytest.raises(ConfigError) as error:
        job(JOB, "algorithm.name=perfedavg", *[f"algorithm.perfedavg.{o}" for o in overrides])
    message = str(error.value)
    assert message.startswith(f"{key}:") and "\n" not in message


@pytest.mark.parametrize(
    ("variant", "epochs", "need"), [("fo", 1, 2), ("fo", 2, None), ("hf", 2, 3), ("hf", 3, None)]
)
def test_a_silo_whose_round_holds_no_whole_meta_step_is_refused_at_build(
    job, variant, epochs, need
):
    """One batch an epoch (train.batch_size above the silo's rows): a round of fewer batches than
    a meta-step takes would undo its inner step and send a zero update every round."""
    overrides = (
        "train.batch_size=4096",
        f"train.local_epochs={epochs}",
        f"algorithm.perfedavg.variant={variant}",
    )
    if need is None:
        silos, server = federation(job, "perfedavg", *overrides)
        updates = play_round(silos, server, 1)[0]
        assert all(any(np.any(d != 0) for d in u.delta.values()) for u in updates)
        return
    with pytest.raises(FederationError) as caught:
        federation(job, "perfedavg", *overrides)
    assert re.fullmatch(
        rf"silo cleveland: its \d+ training rows make {epochs} batch\(es\) a round "
        rf"\(train.batch_size=4096, train.local_epochs={epochs}\), but a meta-step of perfedavg "
        rf"\(variant={variant}\) takes {need}, so it would train nothing; lower train.batch_size "
        "or raise train.local_epochs",
        str(caught.value),
    )
