"""Our SGD and Adam follow torch.optim's update rules exactly."""

import pytest
import torch

from silo_pfl.optim import SGD, Adam


def _train(make, steps: int = 6) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.ReLU(), torch.nn.Linear(4, 3))
    x, y = torch.randn(16, 5), torch.randint(0, 3, (16,))
    optimizer = make(list(model.parameters()))
    for _ in range(steps):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        (lambda p: SGD(p, lr=0.1), lambda p: torch.optim.SGD(p, lr=0.1)),
        (
            lambda p: SGD(p, lr=0.05, momentum=0.9, weight_decay=0.01),
            lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=0.01),
        ),
        (lambda p: Adam(p, lr=0.01), lambda p: torch.optim.Adam(p, lr=0.01)),
        (
            lambda p: Adam(p, lr=0.01, weight_decay=0.1),
            lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=0.1),
        ),
    ],
)
def test_matches_torch_optim(ours, theirs):
    mine, reference = _train(ours), _train(theirs)
    initial = _train(ours, steps=0)
    for a, b, c in zip(mine, reference, initial, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert not torch.equal(a, c)
