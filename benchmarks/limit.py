"""The limit a federation's rounds are measured against: the same FedAvg SGD in plain PyTorch.

Per silo the same data (`load_silo_data`), the same initial model (`init_model`), the same
batches (torch.randperm with the silo's seeded generator), epochs and optimizer
(`silo_pfl.optim.SGD`, what the silos use), an evaluation on its validation and test rows each
round, and the server's averaging (`aggregation.weighted_mean` in silo-name order, then
`apply_delta`). Silos are dealt over worker processes (multiprocessing, spawn) as packing deals
them over Ray workers. A round is one message to each process with the global state (it
evaluates the previous round's model, then fits each of its silos) and one back with the deltas,
then the mean. Nothing is checkpointed and nothing else runs: only FedAvg's arithmetic, which
must give the federation's final model bit for bit.
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from silo_pfl.aggregation import apply_delta, weighted_mean
from silo_pfl.config import FederationConfig
from silo_pfl.data import load_silo_data, silo_names
from silo_pfl.optim import SGD
from silo_pfl.seeding import derive_seed
from silo_pfl.settings import load_config
from silo_pfl.silo import init_model

State = dict[str, np.ndarray]
JOIN_TIMEOUT_S = 30.0


class PlainSilo:
    """One silo's data and model, trained and evaluated with plain PyTorch."""

    def __init__(self, cfg: FederationConfig, name: str) -> None:
        data = load_silo_data(cfg.data, name, cfg.seed)
        self.cfg, self.name = cfg, name
        self.train = torch.from_numpy(data.x_train), torch.from_numpy(data.y_train)
        self.val = torch.from_numpy(data.x_val), torch.from_numpy(data.y_val)
        self.test = torch.from_numpy(data.x_test), torch.from_numpy(data.y_test)
        self.model = init_model(cfg, data.input_shape, data.num_classes)
        self.loss, self.steps = 0.0, 0

    def load(self, state: State) -> dict[str, torch.Tensor]:
        incoming = {k: torch.tensor(v) for k, v in state.items()}
        self.model.load_state_dict(incoming)
        return incoming

    def fit(
        self, state: State, round_: int, correction: dict[str, torch.Tensor] | None = None
    ) -> tuple[State, int]:
        """FedAvg's local epochs from `state`: the delta of every key, and the rows trained on.
        With `correction` (SCAFFOLD's c - c_i, by parameter name), each step follows g + it."""
        reference = self.load(state)
        train = self.cfg.train
        optimizer = SGD(self.model.parameters(), train.lr, train.momentum, train.weight_decay)
        seed = derive_seed(self.cfg.seed, "shuffle", self.name, round_, "all")
        generator = torch.Generator().manual_seed(seed)
        x, y = self.train
        self.model.train()
        self.loss, self.steps = 0.0, 0
        for _ in range(train.local_epochs):
            order = torch.randperm(len(x), generator=generator)
            for start in range(0, len(x), train.batch_size):
                idx = order[start : start + train.batch_size]
                optimizer.zero_grad()
                loss = nn.functional.cross_entropy(self.model(x[idx]), y[idx])
                loss.backward()
                if correction is not None:
                    for name, param in self.model.named_parameters():
                        param.grad += correction[name]
                optimizer.step()
                self.steps += 1
                self.loss += float(loss.detach())
        after = self.model.state_dict()
        return {k: (after[k] - reference[k]).numpy() for k in reference}, len(y)

    @torch.no_grad()
    def evaluate(self, state: State) -> list[tuple[float, float]]:
        """Accuracy and mean loss of `state` on the validation and on the test rows."""
        self.load(state)
        self.model.eval()
        scores = []
        for x, y in (self.val, self.test):
            logits = self.model(x)
            loss = float(nn.functional.cross_entropy(logits, y, reduction="sum")) / max(1, len(y))
            scores.append((float((logits.argmax(dim=1) == y).float().mean()), loss))
        return scores


Fits = list[tuple[str, State, int]]  # each silo's name, delta and rows trained on
Answer = tuple[Fits, list[Any]]  # a worker's fits and evaluations of a round, as `step` returns
Exchange = Callable[[State, int], list[Answer]]  # the state and round to every worker: answers


def step(silos: Sequence[PlainSilo], state: State, round_: int) -> Answer:
    """A worker's part of a round: evaluate `state` (the previous round's model) unless round is
    1, then fit every silo unless round is 0."""
    evals = [s.evaluate(state) for s in silos] if round_ != 1 else []
    fits = [(s.name, *s.fit(state, round_)) for s in silos] if round_ else []
    return fits, evals


def plain_silos(job: str, overrides: Sequence[str], names: Sequence[str]) -> list[PlainSilo]:
    """A worker's silos, its torch threads set as a silo's worker sets them."""
    cfg = load_config(job, list(overrides))
    torch.set_num_threads(cfg.train.torch_threads)
    return [PlainSilo(cfg, name) for name in names]


def serve(connection: Any, job: str, overrides: Sequence[str], names: Sequence[str]) -> None:
    """A limit worker holding silos `names`, answering each message (state, round) with `step`."""
    silos = plain_silos(job, overrides, names)
    connection.send("ready")
    while (message := connection.recv()) is not None:
        connection.send(step(silos, *message))


def run_limit(
    job: str, overrides: Sequence[str], rounds: int, processes: int
) -> tuple[list[float], State]:
    """Seconds of each round of the limit on `processes` worker processes, and its final
    global model. Starting the processes and loading the data are not timed."""
    cfg = load_config(job, list(overrides))
    names = silo_names(cfg.data)
    context = multiprocessing.get_context("spawn")
    pipes, workers = [], []
    for group in deal(names, processes):
        parent, child = context.Pipe()
        worker = context.Process(target=serve, args=(child, job, list(overrides), group))
        worker.start()
        pipes.append(parent)
        workers.append(worker)

    def exchange(state: State, round_: int) -> list[Answer]:
        for pipe in pipes:
            pipe.send((state, round_))
        return [pipe.recv() for pipe in pipes]

    try:
        for pipe in pipes:
            pipe.recv()
        result = drive(cfg, rounds, exchange)
        for pipe in pipes:
            pipe.send(None)
        return result
    finally:
        for worker in workers:
            worker.join(timeout=JOIN_TIMEOUT_S)
            if worker.is_alive():
                worker.kill()


def deal(names: Sequence[str], workers: int) -> list[list[str]]:
    """The silos of each worker, dealt as `runtime.packing` deals them."""
    return [list(names[i::workers]) for i in range(min(workers, len(names)))]


def drive(cfg: FederationConfig, rounds: int, exchange: Exchange) -> tuple[list[float], State]:
    """The rounds of a limit whose workers answer `exchange`: per round, the global state to
    every worker and their fits back, then the server's mean. Returns each round's seconds and
    the final global model; the last round's evaluation is not timed."""
    names = silo_names(cfg.data)
    initial = init_model(cfg, *_shape(cfg, names[0])).state_dict()
    state = {k: v.numpy().copy() for k, v in initial.items()}
    seconds = []
    for round_ in range(1, rounds + 1):
        began = time.perf_counter()
        answers = exchange(state, round_)
        fits = sorted((fit for fits, _ in answers for fit in fits), key=lambda f: f[0])
        mean = weighted_mean([delta for _, delta, _ in fits], [n for _, _, n in fits])
        state = apply_delta(state, mean)
        seconds.append(time.perf_counter() - began)
    exchange(state, 0)
    return seconds, state


def _shape(cfg: FederationConfig, name: str) -> tuple[tuple[int, ...], int]:
    data = load_silo_data(cfg.data, name, cfg.seed)
    return data.input_shape, data.num_classes


def same_model(a: State, b: State) -> bool:
    """Whether two global models are equal bit for bit."""
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
