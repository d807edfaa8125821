"""The plain, named structures that cross process boundaries between silos, server and driver."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from silo_pfl.errors import FederationError
from silo_pfl.secure.messages import Pairing


@dataclass(frozen=True)
class SiloInfo:
    """What a silo reports after set-up: sizes and shapes, never data."""

    silo: str
    num_train: int  # the rows it trains on (its weight in the aggregate), validation rows apart
    num_val: int
    num_test: int
    input_shape: tuple[int, ...]
    num_classes: int
    node_id: str = ""
    identity_key: bytes = b""  # its public Ed25519 identity, only under aggregation.secure
    pid: int = 0  # the silo's process, for operators (and fault tests)
    # Its training rows per class (counts only, for the run report's partition figure); empty
    # unless privacy.central_models=full keeps them, and under aggregation.secure.
    label_counts: tuple[int, ...] = ()
    columns: str = ""  # SHA-256 of its raw columns' names, in order (`columns_digest`)


@dataclass(frozen=True)
class RejoinInfo:
    """A restarted or resumed silo: the round it goes on from (the commit it restored, or the
    round whose aggregated update's state it took back and committed) and a digest of its
    local keys."""

    silo: str
    round: int
    local_digest: str  # SHA-256 of the restored local keys (see tensor_state.local_digest)
    pid: int


@dataclass(frozen=True)
class SplitInfo:
    """A silo's model split: parameter counts and what it sends each round."""

    global_parameters: int
    local_parameters: int
    bytes_sent_per_round: int
    model_bytes: int = 0  # every state_dict entry once: what full-model FedAvg sends per round


@dataclass(frozen=True)
class SiloUpdate:
    """One silo's contribution to a round: a delta of the global keys, the named extras its
    algorithm sends (each keyed like the global keys), and its weight.

    Under secure aggregation `delta` and `extras` are empty and `num_examples` 0: all travel
    inside `masked`.
    """

    silo: str
    round: int
    num_examples: int
    delta: dict[str, np.ndarray]
    masked: np.ndarray | None = None  # uint64, see silo_pfl.secure
    extras: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    attempt: int = 1  # the round's attempt it was made for
    pairing: Pairing | None = None  # under secure aggregation: the peers it masked with, signed


@dataclass(frozen=True)
class FitMetrics:
    """What the driver learns about a silo's local training."""

    silo: str
    round: int
    train_loss: float
    train_seconds: float
    bytes_sent: int
    withheld: str = ""  # why the silo sent no update this round (its training diverged)
    bytes_received: int = 0  # the global keys and the strategy's broadcast it trained from
    secure_seconds: float = 0.0  # masking its update, under aggregation.secure
    # The last round it had committed as this fit began: the driver learns of a commit whose
    # answer came after the round's deadline (its checkpoint is on the silo's disk all the same).
    committed: int = 0


@dataclass(frozen=True)
class RoundReport:
    """The server's account of one round's aggregation."""

    round: int
    accepted: tuple[str, ...]  # silos whose updates were aggregated
    rejected: dict[str, str]  # silo -> why its update was rejected
    aggregated: bool  # False: no quorum; the global state did not change
    reason: str = ""  # why not aggregated
    # Under secure: the question the survivors answer before the sum can be unmasked.
    unmask: Any = None
    secure_seconds: float = 0.0  # unmasking, summing and decoding the masked updates

    def verdict(self) -> Verdict:
        """What the silos are told of the round: not the other silos' reasons (a rejected
        update's norm, say), which stay with the driver."""
        return Verdict(self.round, self.aggregated, self.accepted)


@dataclass(frozen=True)
class Verdict:
    """A round's report as the silos see it: whether it was aggregated, and whose updates."""

    round: int
    aggregated: bool
    accepted: tuple[str, ...]


@dataclass(frozen=True)
class EvalMetrics:
    """A silo's personalized model (this round's global keys + its local keys), evaluated."""

    silo: str
    round: int
    val_accuracy: float
    val_loss: float
    test_accuracy: float
    test_loss: float
    bytes_received: int = 0  # the round's new global keys it evaluated
    # why this personalized model can never be selected: a value of it is not finite (e.g.
    # fine-tuning diverged at evaluation)
    diverged: str = ""


@dataclass(frozen=True)
class CallFailed:
    """What a worker answers for one of its silos whose call raised, in a call made for several:
    the error in one line ("ValueError: ..."), so the others' answers still arrive. `lost`: the
    worker restarted and holds the silo no more (errors.SiloLost), which counts as its death."""

    error: str
    lost: bool = False


@dataclass(frozen=True)
class SiloOutcome:
    """A silo's final, selected personalized model and how it scores."""

    silo: str
    selected_round: int
    val_accuracy: float
    test_accuracy: float
    final_test_accuracy: float
    extras: dict[str, float] = field(default_factory=dict)


def columns_digest(columns: Sequence[str]) -> str:
    """A SHA-256 of a silo's raw column names in their order: what silos compare, so that the
    same shape with columns renamed or in another order is caught, without the names leaving
    the silo."""
    return hashlib.sha256("\x1f".join(columns).encode()).hexdigest()


def model_shape(infos: Sequence[SiloInfo]) -> tuple[tuple[int, ...], int]:
    """The input shape every silo shares, and the number of classes over all silos. The silos'
    raw columns must be the same, by name and in order: the shared layers read them by place."""
    first = infos[0]
    for info in infos[1:]:
        if info.input_shape != first.input_shape:
            raise FederationError(
                f"silo {info.silo}: inputs of shape {info.input_shape}, but silo {first.silo} "
                f"has {first.input_shape}; every silo must share one feature layout"
            )
        if info.columns != first.columns:
            raise FederationError(
                f"silo {info.silo}: its data's columns differ from silo {first.silo}'s in name or "
                "order; every silo's data needs the same columns, in the same order, as the "
                "shared layers read each input by its place"
            )
    return first.input_shape, max(info.num_classes for info in infos)


def fields_of(record: Any) -> dict[str, Any]:
    """A dataclass's fields as a dict, as `dataclasses.asdict` gives them but without its deep
    copy: for a record whose values are plain data, about to be pickled or encoded (a silo's
    metrics in its checkpoint, a round's summary in the server's)."""
    return dict(vars(record))
