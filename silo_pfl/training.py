"""The one training loop over batches and epochs, and the one evaluation.

Algorithms never copy this loop: they choose which parameters train in each phase and may add a
term to the loss (FedProx's proximal term, Ditto's pull towards the global model).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
from torch import nn

from silo_pfl.config import TrainConfig
from silo_pfl.optim import SGD, Adam, Optimizer

ExtraLoss = Callable[[nn.Module], torch.Tensor | None]


@dataclass(frozen=True)
class EvalResult:
    """Accuracy and mean cross-entropy over a set of examples."""

    accuracy: float
    loss: float
    count: int


def make_optimizer(params: Iterable[nn.Parameter], cfg: TrainConfig) -> Optimizer:
    """The optimizer named by train.optimizer."""
    if cfg.optimizer == "adam":
        return Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


def batches_per_epoch(rows: int, batch_size: int, batchnorm: bool) -> int:
    """The steps an epoch of `train_epochs` takes over `rows` rows: one a batch, less a batch of
    one row where the model has BatchNorm, which cannot normalise it."""
    full, rest = divmod(rows, batch_size)
    smallest = _smallest_batch(rows, batchnorm)
    return (full if batch_size >= smallest else 0) + (1 if rest >= smallest else 0)


def _smallest_batch(rows: int, batchnorm: bool) -> int:
    """A lone example cannot be batch-normalised in train mode; it is dropped from its epoch."""
    return 2 if rows >= 2 and batchnorm else 1


def train_epochs(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    epochs: int,
    batch_size: int,
    optimizer: Optimizer,
    generator: torch.Generator,
    extra_loss: ExtraLoss | None = None,
    max_steps: int | None = None,
) -> float:
    """Train `epochs` passes over (x, y) in shuffled mini-batches, stopping early after
    `max_steps` optimizer steps if set, then `optimizer.finish()`; return the mean batch loss:
    the task's cross-entropy alone, without the algorithm's extra term (FedProx's and Ditto's
    proximal terms, SCAFFOLD's correction), which steers the gradients but is not a loss
    comparable between algorithms (SCAFFOLD's is linear in the weights, of any sign)."""
    model.train()
    total, steps = 0.0, 0
    n = len(x)
    min_batch = _smallest_batch(n, has_batchnorm(model))
    for _ in range(epochs):
        order = torch.randperm(n, generator=generator)
        for start in range(0, n, batch_size):
            if max_steps is not None and steps >= max_steps:
                break
            idx = order[start : start + batch_size]
            if len(idx) < min_batch:
                continue
            backward = partial(_backward, model, x[idx], y[idx], optimizer, extra_loss)
            loss = backward()
            optimizer.step(partial(_keeping_buffers, model, backward))
            total += float(loss.detach())
            steps += 1
    optimizer.finish()
    return total / steps if steps else float("nan")


def _backward(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    optimizer: Optimizer,
    extra_loss: ExtraLoss | None,
) -> torch.Tensor:
    """The gradients of a step's loss on the batch (x, y), with the algorithm's extra term;
    returns the batch's cross-entropy, the task's loss without that term."""
    optimizer.zero_grad()
    task = nn.functional.cross_entropy(model(x), y)
    extra = extra_loss(model) if extra_loss is not None else None
    (task if extra is None else task + extra).backward()
    return task


def _keeping_buffers(model: nn.Module, backward: Callable[[], torch.Tensor]) -> torch.Tensor:
    """The optimizer's closure: `backward()` (`_backward` on the step's batch, at the parameters
    as they are now), with the model's buffers (BatchNorm's running statistics) put back as the
    step's own pass left them: only that pass counts as having seen the batch."""
    buffers = [b.clone() for b in model.buffers()]
    loss = backward()
    with torch.no_grad():
        for buffer, saved in zip(model.buffers(), buffers, strict=True):
            buffer.copy_(saved)
    return loss


def evaluate(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 1024
) -> EvalResult:
    """Accuracy and mean loss of the model on (x, y), in eval mode."""
    return evaluate_parts(model, x, y, (len(x),), batch_size)[0]


@torch.no_grad()
def evaluate_parts(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    sizes: Sequence[int],
    batch_size: int = 1024,
) -> list[EvalResult]:
    """`evaluate` on each of the consecutive parts of (x, y) of `sizes` rows (a silo's validation
    and test rows), in one pass of the model over them all: a call of the model, and a switch to
    eval mode, cost the same for a few rows as for many."""
    if sum(sizes) != len(x):
        raise ValueError(f"evaluate_parts: parts of {sum(sizes)} rows in all, for {len(x)} rows")
    if len(x) == 0:
        return [EvalResult(float("nan"), float("nan"), 0) for _ in sizes]
    model.eval()
    losses, hits = [], []
    for start in range(0, len(x), batch_size):
        logits = model(x[start : start + batch_size])
        target = y[start : start + batch_size]
        losses.append(nn.functional.cross_entropy(logits, target, reduction="none"))
        # A row whose logits are not all finite is wrong: argmax would read NaNs as class 0.
        hits.append((logits.argmax(dim=1) == target) & torch.isfinite(logits).all(dim=1))
    loss, hit = torch.cat(losses), torch.cat(hits)
    results, start = [], 0
    for size in sizes:
        if size == 0:
            results.append(EvalResult(float("nan"), float("nan"), 0))
            continue
        part = slice(start, start + size)
        mean_loss = float(loss[part].sum(dtype=torch.float64)) / size
        accuracy = int(hit[part].sum()) / size
        results.append(EvalResult(accuracy, mean_loss, size))
        start += size
    return results


def has_batchnorm(model: nn.Module) -> bool:
    """Whether `model` holds a BatchNorm layer, which cannot normalise a lone example."""
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def to_tensors(x: np.ndarray, y: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs as float32 and labels as int64 tensors, sharing memory where possible."""
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)), torch.from_numpy(
        np.ascontiguousarray(y, dtype=np.int64)
    )


def copy_into(
    model: nn.Module, tensors: dict[str, torch.Tensor], who: str
) -> dict[str, torch.Tensor]:
    """Copy each of `tensors` into the parameter or buffer of `model` of the same name: what
    `load_state_dict(strict=False)` does for these keys, without its walk over every module and
    hook (about a quarter of a millisecond a call for a small model). A name the model lacks or a
    shape that differs is an error naming `who`. Returns the model's parameters and buffers."""
    targets = model.state_dict(keep_vars=True)
    with torch.no_grad():
        for key, value in tensors.items():
            target = targets.get(key)
            if target is None or target.shape != value.shape:
                have = "no such key" if target is None else f"shape {tuple(target.shape)}"
                raise ValueError(
                    f"{who}: {key} of shape {tuple(value.shape)}: the model has {have}"
                )
            target.copy_(value)
    return targets


def shared_tensors(arrays: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """Each of `arrays` as a tensor over its own memory, not a copy. A read-only array (Ray's
    object store hands every reader a read-only view of one shared buffer) gives a tensor that
    must never be written: torch cannot mark it read-only, and only warns that it is, which is
    expected here. One filter for the whole dict: setting one up costs more than the tensor."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The given NumPy array is not writable", UserWarning)
        return {key: torch.from_numpy(np.asarray(array)) for key, array in arrays.items()}
