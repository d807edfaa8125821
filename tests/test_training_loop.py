"""The loss the shared loop reports is the task's cross-entropy. An algorithm's extra term
(FedProx's and Ditto's proximal terms, SCAFFOLD's correction) steers the gradients only."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from silo_pfl.optim import SGD
from silo_pfl.training import batches_per_epoch, evaluate, train_epochs

ROWS, BATCH, EPOCHS, SEED = 20, 8, 2, 3


def _data() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    return model, torch.randn(ROWS, 4), torch.randint(0, 3, (ROWS,))


def _linear_term(direction: list[torch.Tensor]):
    """SCAFFOLD's kind of term: <d, w>, of any sign, whose gradient is d."""
    return lambda model: sum(
        (p * d).sum() for p, d in zip(model.parameters(), direction, strict=True)
    )


def test_the_reported_loss_is_the_cross_entropy_without_the_extra_term():
    model, x, y = _data()
    direction = [torch.full_like(p, -50.0) for p in model.parameters()]
    reported = train_epochs(
        model,
        x,
        y,
        epochs=EPOCHS,
        batch_size=BATCH,
        optimizer=SGD(model.parameters(), lr=0.0),  # the weights stay put: each batch by hand
        generator=torch.Generator().manual_seed(SEED),
        extra_loss=_linear_term(direction),
    )
    generator, losses = torch.Generator().manual_seed(SEED), []
    with torch.no_grad():
        for _ in range(EPOCHS):
            order = torch.randperm(ROWS, generator=generator)
            for start in range(0, ROWS, BATCH):
                idx = order[start : start + BATCH]
                losses.append(float(nn.functional.cross_entropy(model(x[idx]), y[idx])))
    assert reported == pytest.approx(sum(losses) / len(losses), rel=1e-6)
    assert 0 < reported < 5  # the term's value, about -50 times the weights' sum, is not in it


def test_the_extra_term_still_steers_the_step():
    """One full-batch step of plain SGD: w - lr * (grad of the cross-entropy + d)."""
    model, x, y = _data()
    direction = [torch.randn_like(p) for p in model.parameters()]
    start = [p.detach().clone() for p in model.parameters()]
    model.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    pairs = zip(start, model.parameters(), direction, strict=True)
    expected = [w - 0.1 * (p.grad + d) for w, p, d in pairs]
    train_epochs(
        model,
        x,
        y,
        epochs=1,
        batch_size=ROWS,
        optimizer=SGD(model.parameters(), lr=0.1),
        generator=torch.Generator().manual_seed(SEED),
        extra_loss=_linear_term(direction),
    )
    for param, want in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(param.detach(), want, rtol=1e-6, atol=1e-7)


class CountingSGD(SGD):
    """Plain SGD that counts the loop's steps."""

    def __init__(self, params) -> None:
        super().__init__(params, lr=0.0)
        self.count = 0

    def step(self, closure=None) -> None:
        self.count += 1


@pytest.mark.parametrize(
    ("rows", "batch_size", "batchnorm"),
    # one row alone with BatchNorm is refused at the silo's build, before any loop
    [
        (1, 4, False),
        *(
            (r, b, bn)
            for r, b in ((2, 4), (8, 4), (9, 4), (10, 4), (5, 2), (7, 1))
            for bn in (False, True)
            if b > 1 or not bn
        ),
    ],
)
def test_batches_per_epoch_is_the_steps_an_epoch_of_the_loop_takes(rows, batch_size, batchnorm):
    torch.manual_seed(0)
    layers = [nn.Linear(4, 3)] + ([nn.BatchNorm1d(3)] if batchnorm else [])
    model = nn.Sequential(*layers)
    optimizer = CountingSGD(model.parameters())
    x, y = torch.randn(rows, 4), torch.randint(0, 3, (rows,))
    generator = torch.Generator().manual_seed(SEED)
    train_epochs(
        model, x, y, epochs=1, batch_size=batch_size, optimizer=optimizer, generator=generator
    )
    assert batches_per_epoch(rows, batch_size, batchnorm) == optimizer.count


def test_a_model_whose_outputs_are_not_finite_scores_no_row():
    """argmax reads NaN logits as class 0: such a model scored the share of class-0 rows, so
    selection could prefer a diverged personal model to a real one."""
    model = nn.Linear(3, 2)
    x, y = torch.ones(10, 3), torch.tensor([0] * 6 + [1] * 4)
    with torch.no_grad():
        model.weight.zero_()
        model.bias.copy_(torch.tensor([1.0, 0.0]))
    assert evaluate(model, x, y).accuracy == 0.6
    with torch.no_grad():
        model.weight.fill_(float("nan"))
    result = evaluate(model, x, y)
    assert result.accuracy == 0.0 and result.loss != result.loss
