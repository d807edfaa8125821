"""A silo: its private data, its model, and the local keys that never leave it.

A plain class with a narrow API (`setup`, `build`, `fit`, `evaluate`, `commit`,
`evaluate_and_commit`, `select`, `rejoin`, `check_checkpoint`, `outcome`, `attach`, `export`), so
it is tested without Ray; the runtime makes it an actor. Its directory, on its own node
(`silo_store`), holds a checkpoint per committed round (the round's personalized model, its
local keys, its algorithm's personal state, which model is selected, its RNG state: one file,
arrays under a GHASH) and its selected personalized model, which only the exporters attached to
it may send anywhere.

Each committed round's checkpoint holds its model, since the driver may select it. `commit` is
given the driver's choice at once; `evaluate_and_commit` commits without waiting for it (the
silo goes straight on to its next fit) and is given it a round later, or by `select` after the
last round. The selected model is published (in torch's format, with its SHA-256, as MLflow
serves it) once the choice is final.

A round changes the silo only when it commits: a fit that is not committed (the silo was late,
its update was rejected, the round was retried) is rolled back to the last commit before the
next fit, so a retried round computes exactly what it would have the first time.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from silo_pfl import checkpoint
from silo_pfl.aggregation import flatten
from silo_pfl.algorithms import build_algorithm
from silo_pfl.algorithms.base import Phase
from silo_pfl.config import FederationConfig
from silo_pfl.data import Preprocessing, SiloData, input_example, load_silo_data, silo_names
from silo_pfl.errors import FederationError
from silo_pfl.messages import (
    EvalMetrics,
    FitMetrics,
    RejoinInfo,
    SiloInfo,
    SiloOutcome,
    SiloUpdate,
    SplitInfo,
    columns_digest,
    fields_of,
)
from silo_pfl.models import BodyHeadModel, build_model
from silo_pfl.paths import check_dir_path
from silo_pfl.run_dir import silo_dir
from silo_pfl.secure import identity
from silo_pfl.secure.client import SecureClient
from silo_pfl.secure.fixed_point import vector_length
from silo_pfl.secure.messages import Advertisement, Reveal, SealedShares, UnmaskRequest
from silo_pfl.secure.params import secure_params
from silo_pfl.seeding import derive_seed, rng_state, seed_everything, set_rng_state
from silo_pfl.settings import from_dict, split_rules
from silo_pfl.silo_store import SiloStore
from silo_pfl.split import Split, compute_split
from silo_pfl.tensor_state import as_arrays, as_tensors, first_not_finite, local_digest, nbytes
from silo_pfl.training import (
    ExtraLoss,
    batches_per_epoch,
    copy_into,
    evaluate_parts,
    has_batchnorm,
    shared_tensors,
    to_tensors,
    train_epochs,
)


def init_model(
    cfg: FederationConfig, input_shape: tuple[int, ...], num_classes: int
) -> BodyHeadModel:
    """The federation's initial model, as its algorithm needs it: identical on every silo and on
    the server. Drawn from a generator of its own: the process's torch generator (a silo's, seeded
    by its name) is left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(cfg.seed, "init"))
        model = build_model(
            cfg.model.name, input_shape, num_classes, cfg.model.hidden, cfg.model.adapter_dim
        )
        return build_algorithm(cfg.algorithm, cfg.train).prepare_model(model)


@dataclass(frozen=True)
class PersonalizedModel:
    """A silo's selected personalized model (global + its local keys), as an exporter sees it."""

    silo: str
    config: FederationConfig
    state_path: Path  # the state_dict of the selected model (Silo.selected_path)
    input_shape: tuple[int, ...]
    num_classes: int
    preprocessing: Preprocessing
    raw_columns: tuple[str, ...]  # the raw layout the model answers on (see data.raw_encoder)
    example: np.ndarray  # a synthetic raw row from the schema (data.input_example), no real value
    outcome: SiloOutcome
    val_rows: str  # SiloData.validation_digest: which versions' validation scores compare


class SiloExporter(Protocol):
    """Sends a silo's selected personalized model to a store; runs inside the silo's process."""

    def check(self, silo: str) -> None:
        """Before round 1: raise a one-line SiloPflError if the store cannot take the model."""

    def export(self, model: PersonalizedModel) -> dict[str, str]:
        """Store the model; return a receipt of plain strings (e.g. the model's URI)."""


class Silo:
    """One participant. Only `Split.outgoing` payloads and attached exporters ever leave it."""

    def __init__(
        self, config: dict[str, Any] | FederationConfig, name: str, run_id: str = "default"
    ) -> None:
        """`config` is the driver's validated config, as `config.to_dict` sent it or already
        rebuilt (silos sharing a process share one, read-only)."""
        self.cfg = config if isinstance(config, FederationConfig) else from_dict(config)
        self.name = name
        self.dir = silo_dir(self.cfg, run_id, name)
        self.store = SiloStore(self.dir)
        self.algorithm = build_algorithm(self.cfg.algorithm, self.cfg.train)
        self._last: EvalMetrics | None = None
        self._selected: EvalMetrics | None = None
        self._selected_report: dict[str, float] = {}  # the algorithm's figures of that model
        self._selected_sha256 = ""  # of its published file ('' until it is published)
        # The figures of the committed models that may still be selected: round -> eval, report.
        self._models: dict[int, dict[str, Any]] = {}
        self._exporters: dict[str, SiloExporter] = {}
        self._identity: Any = None  # its Ed25519 identity, under aggregation.secure
        self._trusted: dict[str, bytes] | None = None  # every silo's identity, as the config lists
        self._secure: SecureClient | None = None
        self._secure_bytes = 0  # its round keys and sealed shares, sent before this attempt's fit
        self._evaluated: nn.Module | None = None  # the model the last evaluate() judged
        self.committed = 0  # the last round whose state this silo checkpointed
        self._dirty = False  # trained since that commit
        self._global_frozen = False  # adapt(): the silo's own model trains its local keys only
        # The received global keys are never written by anyone (Ray's object store: immutable),
        # so that the same arrays, received again, need not be copied in again (the runtime's).
        self.inputs_immutable = False
        self._loaded: tuple[dict[str, np.ndarray], dict[str, tuple[Any, int, int]]] | None = None

    def setup(self, resume: bool = False) -> SiloInfo:
        """Load this silo's private data; report sizes only (and, under secure aggregation, the
        public half of its identity). A fresh run starts a fresh directory; `resume` keeps it."""
        seed_everything(derive_seed(self.cfg.seed, "silo", self.name))
        torch.set_num_threads(self.cfg.train.torch_threads)
        data: SiloData = load_silo_data(self.cfg.data, self.name, self.cfg.seed)
        self.data = data
        self.data_digest = data.digest()  # checkpointed: a resume on other data is refused
        self.train_xy = to_tensors(data.x_train, data.y_train)
        self.held_out_xy = to_tensors(  # validation rows, then test rows: for evaluate_parts
            np.concatenate([data.x_val, data.x_test]), np.concatenate([data.y_val, data.y_test])
        )
        val_rows = len(data.y_val)
        self.val_xy = self.held_out_xy[0][:val_rows], self.held_out_xy[1][:val_rows]
        self.test_xy = self.held_out_xy[0][val_rows:], self.held_out_xy[1][val_rows:]
        if resume and not self.dir.is_dir():
            raise FederationError(f"silo {self.name}: no state to resume from in {self.dir}")
        if not resume:
            self.store.start_fresh()
        if self.cfg.aggregation.secure:
            keys = identity.key_dir(self.cfg, self.name)
            check_dir_path(
                keys, f"silo {self.name}: key directory {keys} (silos.{self.name}.key_dir)"
            )
            self._trusted = identity.configured_keys(self.cfg, silo_names(self.cfg.data))
            self._identity = identity.own_identity(self.cfg, self.name, self._trusted)
            identity.check_own(self.name, identity.public_bytes(self._identity), self._trusted)
        return SiloInfo(
            silo=self.name,
            num_train=len(data.y_train),
            num_val=len(data.y_val),
            num_test=len(data.y_test),
            input_shape=data.input_shape,
            num_classes=data.num_classes,
            identity_key=identity.public_bytes(self._identity) if self._identity else b"",
            pid=os.getpid(),
            label_counts=label_counts(data) if self._counts_leave() else (),
            columns=columns_digest(data.raw_columns),
        )

    def _counts_leave(self) -> bool:
        """Whether this silo's training rows per class go to the central store (`partition.json`):
        only with privacy.label_counts under privacy.central_models=full, and never under
        aggregation.secure."""
        privacy = self.cfg.privacy
        wanted = privacy.label_counts and privacy.central_models == "full"
        return wanted and not self.cfg.aggregation.secure

    def build(
        self,
        input_shape: tuple[int, ...],
        num_classes: int,
        identity_keys: dict[str, bytes] | None = None,
        joining: bool = False,
    ) -> SplitInfo:
        """Build the federation's model (the classes of all silos) and this silo's split.

        Under secure aggregation the silo trusts the identity keys its config lists, or else
        `identity_keys`, the ones every silo reported, as the driver relays them. A silo
        `joining` a trained federation trains its local keys only (`adapt`): an algorithm's
        rule on the batches a round needs is checked only where it has local keys to train."""
        if tuple(input_shape) != self.data.input_shape:
            raise ValueError(f"silo {self.name}: inputs {self.data.input_shape}, not {input_shape}")
        self.model = init_model(self.cfg, tuple(input_shape), num_classes)
        if self.num_examples < 2 and has_batchnorm(self.model):
            raise FederationError(
                f"silo {self.name}: {self.num_examples} training row, but model "
                f"{self.cfg.model.name} has BatchNorm, which needs at least 2 rows in a batch; "
                "give the silo more rows (data.max_train_rows, data.val_fraction) or choose a "
                "model without BatchNorm"
            )
        self._loaded = None
        self.num_classes = num_classes
        self.split: Split = compute_split(self.model, split_rules(self.cfg))
        if self.split.local_keys or not joining:
            per_epoch = batches_per_epoch(
                self.num_examples, self.cfg.train.batch_size, has_batchnorm(self.model)
            )
            self.algorithm.check_batches(self.name, self.num_examples, per_epoch)
        self.algorithm.check_split(self.split)
        state = self.model.state_dict()
        shapes = {k: tuple(state[k].shape) for k in self.split.global_keys}
        sent = self.split.global_bytes * (1 + len(self.algorithm.Strategy.extras))
        if self._identity is not None:
            trusted = self._trusted or identity_keys or {}
            params = secure_params(self.cfg, silo_names(self.cfg.data))
            self._secure = SecureClient(params, self.name, self._identity, trusted)
            like = {name: shapes for name in self.algorithm.Strategy.extras}
            sent = 8 * vector_length(flatten(shapes, like))
        if not self.store.rounds():  # a resumed silo restores its own
            self._checkpoint(0)
        return SplitInfo(
            global_parameters=self.split.global_parameters,
            local_parameters=self.split.local_parameters,
            bytes_sent_per_round=sent,
            model_bytes=sum(v.numel() * v.element_size() for v in state.values()),
        )

    def rejoin(
        self,
        input_shape: tuple[int, ...],
        num_classes: int,
        identity_keys: dict[str, bytes],
        round_: int,
        exporters: dict[str, SiloExporter] | None = None,
        aggregated: tuple[int, int] | None = None,
    ) -> RejoinInfo:
        """After a restart: set up again from this silo's own directory, restore bit for bit
        the state it committed in `round_`, and take its exporters back. `aggregated`: the
        (round, attempt) after `round_` whose update the server aggregated before this silo
        could commit it. Where the server mirrors the algorithm's state, that fit's state is
        taken back and committed as that round's, unevaluated; RejoinInfo names the round."""
        info = self.setup(resume=True)
        self.build(input_shape, num_classes, identity_keys)
        digest = self.restore(round_)
        self.adopt_sent(aggregated)
        self.attach(exporters or {})
        return RejoinInfo(self.name, self.committed, digest, info.pid)

    def adopt_sent(self, aggregated: tuple[int, int] | None) -> int:
        """After `restore`: where the server mirrors the algorithm's state and aggregated this
        silo's update of (round, attempt) `aggregated`, after its last commit, take back the
        state that fit kept before the update left, and commit it as that round's, unevaluated
        (the server's mirror holds it already). Returns the round now committed."""
        if aggregated is not None and self.algorithm.server_mirrors_state:
            sent_round, attempt = aggregated
            state = self.store.load_sent(sent_round, attempt)
            self.algorithm.load_local_state(self, as_tensors(state))
            self._checkpoint(sent_round)
        return self.committed

    def _checkpoint(
        self, round_: int, model: dict[str, np.ndarray] | None = None, own: bool = False
    ) -> None:
        """Write the checkpoint of `round_`, with `model`, the round's personalized model, if
        given; `own`: that model is this silo's model as it is now, whose local keys are read
        from it. The selected round's is kept beyond checkpoint.KEEP: it holds the model."""
        local_keys = self.split.local_keys
        if own and model is not None:
            local = {k: model[k] for k in local_keys}
        else:
            state = self.model.state_dict()
            local = as_arrays({k: state[k] for k in local_keys})
        figures = {  # one JSON string: one object for the pickler, not dozens
            "selected": fields_of(self._selected) if self._selected else None,
            "selected_report": self._selected_report,
            "selected_sha256": self._selected_sha256,
            "last": fields_of(self._last) if self._last else None,
            "models": {str(r): f for r, f in self._models.items()},
        }
        saved = {
            "round": round_,
            "local": local,
            "algorithm": as_arrays(self.algorithm.local_state()),
            "figures": json.dumps(figures),
            "rng": rng_state(),
            "data": self.data_digest,
        }
        spare = self._selected.round if self._selected is not None else None
        self.store.save(round_, saved, model, self.split, spare)
        self.committed, self._dirty = round_, False

    def restore(self, round_: int) -> str:
        """Load the checkpoint of `round_`; return the SHA-256 of the restored local keys."""
        state = self.store.load(round_)
        if state.get("data", self.data_digest) != self.data_digest:  # absent: an older version's
            raise FederationError(
                f"silo {self.name}: its data differ from those it committed round {round_} on "
                "(its files, or the data.* settings, changed since); resume on the data the run "
                "began with, or start a fresh run"
            )
        self.model.load_state_dict(as_tensors(state["local"]), strict=False)
        self.algorithm.load_local_state(self, as_tensors(state["algorithm"]))
        figures = json.loads(state["figures"])
        self._selected = EvalMetrics(**figures["selected"]) if figures["selected"] else None
        self._selected_sha256 = figures["selected_sha256"]
        if self._selected_sha256:  # its published file is there, and is the one selected
            self._check_published()
        self._selected_report = figures["selected_report"]
        self._last = EvalMetrics(**figures["last"]) if figures["last"] else None
        self._models = {int(r): f for r, f in figures.get("models", {}).items()}
        set_rng_state(state["rng"])
        self.committed, self._dirty = round_, False
        return local_digest(self.model.state_dict(), self.split.local_keys)

    def _check_published(self) -> None:
        """The selected model's published file, missing or damaged (a disk's fault, a hand),
        is written again from its round's checkpoint, which holds the model, and said."""
        assert self._selected is not None
        try:
            self.store.check_published(self._selected.round, self._selected_sha256)
        except checkpoint.CheckpointError as exc:
            self._publish()
            print(
                f"warning: silo {self.name}: {exc}; written again from its round's checkpoint",
                file=sys.stderr,
                flush=True,
            )

    def check_checkpoint(self, round_: int) -> str:
        """Why the checkpoint of `round_` cannot be restored (partial, corrupted, missing), in
        one line; "" if it can."""
        try:
            self.store.load(round_)
        except checkpoint.CheckpointError as exc:
            return str(exc)
        return ""

    def _load_global(self, global_state: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """Overwrite the global keys of the model (copied once, into its parameters and
        buffers); the local keys are untouched. Returns the received arrays as tensors over
        their own memory, not copies: under Ray a read-only buffer every silo of the worker
        shares, so neither the silo nor its algorithm may ever write into them."""
        if set(global_state) != set(self.split.global_keys):
            raise ValueError(f"silo {self.name}: received keys differ from its global keys")
        incoming = shared_tensors(global_state)
        if not self._holds(global_state):
            targets = copy_into(self.model, incoming, f"silo {self.name}")
            if self.inputs_immutable:
                self._loaded = (global_state, {k: _written(targets[k]) for k in global_state})
        return incoming

    def _holds(self, global_state: dict[str, np.ndarray]) -> bool:
        """Whether the model's global keys hold `global_state` already: the same immutable
        arrays (the same memory: the object store's one buffer, kept alive by `_loaded`) were
        copied into them last, and nothing has written into them since (torch counts every
        in-place write of a tensor: training, a restore, any copy)."""
        if self._loaded is None:
            return False
        loaded, versions = self._loaded
        if not all(_same_memory(loaded[k], global_state[k]) for k in global_state):
            return False
        targets = self.model.state_dict(keep_vars=True)
        return all(_written(targets[k]) == v for k, v in versions.items())

    @property
    def num_examples(self) -> int:
        """The rows this silo trains on: its weight in every aggregate."""
        return len(self.train_xy[1])

    def train(
        self,
        model: nn.Module,
        phase: Phase,
        round_: int,
        extra_loss: ExtraLoss | None,
        purpose: str = "",
    ) -> float:
        """One phase of the shared loop on `model` (this silo's model, or a personal copy an
        algorithm keeps) over this silo's training rows; returns the mean batch loss."""
        chosen = self._trainable(phase.trainable)
        if self._global_frozen and model is self.model:
            local = self._trainable("local")
            chosen = local if chosen is None else chosen & local
        if chosen is None:  # every key trains, and nothing is frozen: nothing to undo after
            params, frozen = list(model.parameters()), {}
            for param in params:
                if not param.requires_grad:
                    param.requires_grad_(True)
        else:
            params = []
            for name, param in model.named_parameters():
                param.requires_grad_(name in chosen)
                if param.requires_grad:
                    params.append(param)
            # A frozen key stays frozen whole: its buffers too (BatchNorm's running statistics,
            # which the forward passes in train mode would otherwise move).
            frozen = {
                name: buffer.clone() for name, buffer in model.named_buffers() if name not in chosen
            }
        try:
            if not params or phase.epochs == 0:
                return float("nan")
            tags = (purpose, phase.trainable) if purpose else (phase.trainable,)
            generator = torch.Generator().manual_seed(
                derive_seed(self.cfg.seed, "shuffle", self.name, round_, *tags)
            )
            return train_epochs(
                model,
                *self.train_xy,
                epochs=phase.epochs,
                batch_size=self.cfg.train.batch_size,
                optimizer=self.algorithm.optimizer(params, phase, purpose),
                generator=generator,
                extra_loss=extra_loss,
                max_steps=phase.steps,
            )
        finally:
            if chosen is not None:
                for param in model.parameters():
                    param.requires_grad_(True)
                buffers = dict(model.named_buffers())
                with torch.no_grad():
                    for name, value in frozen.items():
                        buffers[name].copy_(value)

    def _trainable(self, which: str) -> set[str] | None:
        """The keys a phase trains: `which` is all (None: every key), global or local."""
        if which == "all":
            return None
        return set(self.split.global_keys if which == "global" else self.split.local_keys)

    def fit(
        self,
        global_state: dict[str, np.ndarray],
        round_: int,
        attempt: int = 1,
        broadcast: dict[str, Any] | None = None,
        inbox: dict[str, bytes] | None = None,
    ) -> tuple[SiloUpdate | None, FitMetrics]:
        """One round of local training from the last committed state, given the global keys and
        what the server's strategy broadcast; returns the delta of the global keys (and the
        algorithm's extras) only. A silo whose training diverges sends no update, and says why.
        Under secure aggregation the update is masked, with the shares in `inbox` (its peers'
        sealed shares of this round)."""
        start = time.perf_counter()
        reference = self._begin(global_state)
        self.algorithm.begin_round(self, reference, broadcast or {})
        metrics = self._run_phases(reference, round_)
        received = nbytes(global_state) + sum(nbytes(v) for v in (broadcast or {}).values())
        metrics = dataclasses.replace(metrics, bytes_received=received)
        state = self.model.state_dict()
        diverged = first_not_finite(state)
        if diverged is not None:
            return None, self._withheld(metrics, start, "training", diverged)
        delta = {k: (state[k] - reference[k]).numpy() for k in self.split.global_keys}
        extras = self.algorithm.update_extras(self, reference)
        payload = self.split.outgoing(delta, extras)
        self.algorithm.after_fit(self, reference, round_)
        diverged = first_not_finite(self.algorithm.local_state())
        if diverged is not None:
            options = f"the options of algorithm.{self.algorithm.name}"
            return None, self._withheld(metrics, start, "its personal training", diverged, options)
        if self.algorithm.server_mirrors_state:
            self.store.save_sent(round_, attempt, as_arrays(self.algorithm.local_state()))
        num_examples = self.num_examples
        masking = 0.0
        if self._secure is None:
            update = SiloUpdate(self.name, round_, num_examples, payload, extras=extras)
            sent = sum(v.nbytes for v in flatten(payload, extras).values())
        else:
            began = time.perf_counter()
            masked = self._secure.mask(
                flatten(payload, extras), num_examples, round_, attempt, inbox or {}
            )
            masking = time.perf_counter() - began
            pairing = self._secure.pairing(round_, attempt)
            update = SiloUpdate(self.name, round_, 0, {}, masked, attempt=attempt, pairing=pairing)
            paired = len(pairing.signature) + len(",".join(pairing.peers))
            sent, self._secure_bytes = masked.nbytes + paired + self._secure_bytes, 0
        return update, dataclasses.replace(
            metrics,
            train_seconds=time.perf_counter() - start,
            bytes_sent=sent,
            secure_seconds=masking,
        )

    def _withheld(
        self,
        metrics: FitMetrics,
        start: float,
        what: str,
        key: str,
        options: str = "the local epochs",
    ) -> FitMetrics:
        """A fit that sends no update because `what` diverged (`key` is not finite): rolled back
        at the next round's start, not evaluated, not committed."""
        reason = (
            f"{what} diverged ({key} is not finite); it sends no update this round. If it "
            f"persists, lower train.lr or {options}"
        )
        sent, self._secure_bytes = self._secure_bytes, 0
        seconds = time.perf_counter() - start
        return dataclasses.replace(metrics, train_seconds=seconds, withheld=reason, bytes_sent=sent)

    def _protocol(self) -> SecureClient:
        if self._secure is None:
            raise FederationError(f"silo {self.name}: aggregation.secure is off")
        return self._secure

    def advertise(self, round_: int, attempt: int) -> Advertisement:
        """Secure aggregation, step 1: this round's signed public keys."""
        advert = self._protocol().advertise(round_, attempt)
        self._secure_bytes += len(advert.cipher_key + advert.mask_key + advert.signature)
        return advert

    def share_keys(self, adverts: list[Advertisement]) -> SealedShares:
        """Secure aggregation, step 2: check the round's peers, seal shares to them."""
        shares = self._protocol().share_keys(adverts)
        self._secure_bytes += sum(len(v) for v in shares.sealed.values())
        return shares

    def confirm(self, request: UnmaskRequest) -> bytes:
        """Secure aggregation, the consistency round: this silo's signature of the unmask
        request it is shown, the one it will reveal shares for."""
        return self._protocol().confirm(request)

    def unmask(self, request: UnmaskRequest) -> Reveal:
        """Secure aggregation, step 4: the shares the server needs to remove the masks (after
        the fit, so not in its bytes_sent: 66 bytes a share)."""
        return self._protocol().unmask(request)

    def _begin(self, global_state: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """Start a round from the last commit, with the round's global keys loaded."""
        if self._dirty:
            self.restore(self.committed)
        self._dirty = True
        return self._load_global(global_state)

    def _run_phases(self, reference: dict[str, torch.Tensor], round_: int) -> FitMetrics:
        """The algorithm's phases of the shared loop on this silo's model; the mean loss."""
        loss_term = self.algorithm.extra_loss
        losses = [
            self.train(self.model, phase, round_, lambda model: loss_term(model, reference))
            for phase in self.algorithm.phases()
        ]
        finite = [loss for loss in losses if np.isfinite(loss)]
        return FitMetrics(
            silo=self.name,
            round=round_,
            train_loss=float(np.mean(finite)) if finite else float("nan"),
            train_seconds=0.0,
            bytes_sent=0,
            committed=self.committed,
        )

    def adapt(self, global_state: dict[str, np.ndarray], round_: int) -> FitMetrics:
        """Cold start: one round of the algorithm's local procedure for a silo joining a
        trained federation. The global keys stay frozen at the federation's `global_state`;
        the local keys, and the algorithm's personal state (a personal model, alpha, a gate),
        train on this silo's rows. Nothing is sent, and the server broadcasts nothing to it. Its
        loss is the mean of its phases' and its personal training's, those it trained."""
        start = time.perf_counter()
        reference = self._begin(global_state)
        self._global_frozen = True
        try:
            metrics = self._run_phases(reference, round_)
            personal = self.algorithm.after_fit(self, reference, round_)
        finally:
            self._global_frozen = False
        losses = [x for x in (metrics.train_loss, personal) if x is not None and np.isfinite(x)]
        return dataclasses.replace(
            metrics,
            train_loss=float(np.mean(losses)) if losses else float("nan"),
            train_seconds=time.perf_counter() - start,
        )

    def evaluate(self, global_state: dict[str, np.ndarray], round_: int) -> EvalMetrics:
        """Evaluate this round's personalized model: by default the new global keys with this
        silo's own local keys; an algorithm may personalize further (fine-tuning, Ditto)."""
        self._load_global(global_state)
        self._evaluated = self.algorithm.personalized_model(self, round_)
        diverged = first_not_finite(self._evaluated.state_dict())
        sizes = len(self.val_xy[1]), len(self.test_xy[1])
        val, test = evaluate_parts(self._evaluated, *self.held_out_xy, sizes)
        self._last = EvalMetrics(
            self.name,
            round_,
            val.accuracy,
            val.loss,
            test.accuracy,
            test.loss,
            bytes_received=nbytes(global_state),
            diverged=f"{diverged} is not finite" if diverged is not None else "",
        )
        return self._last

    def commit(self, round_: int, keep: bool) -> None:
        """End `round_` for this silo: with `keep`, its model just evaluated becomes (and is
        published as) its selected personalized model; then the model and the silo's state
        are checkpointed in its own directory."""
        if self._last is None or self._last.round != round_:
            raise RuntimeError(f"silo {self.name}: commit({round_}) without evaluate({round_})")
        if not isinstance(keep, bool):
            raise TypeError(f"silo {self.name}: commit's keep is a bool, not {type(keep).__name__}")
        model = self._evaluated_model(round_)
        if keep:
            self._select(round_)
            self._publish(model)
        self._checkpoint(round_, model, own=self._evaluated is self.model)

    def evaluate_and_commit(
        self, global_state: dict[str, np.ndarray], round_: int, selected: int | None
    ) -> EvalMetrics:
        """`evaluate`, then commit the round without waiting for the driver's choice: the model
        is written, and may be selected later. `selected` is the round the driver has selected
        for this silo so far (None: none yet), which becomes its selected model first: a round's
        choice comes with the silo's next call, or with `select` after the last round."""
        self._select(selected)
        metrics = self.evaluate(global_state, round_)
        self._checkpoint(round_, self._evaluated_model(round_), own=self._evaluated is self.model)
        return metrics

    def commit_unevaluated(self, round_: int, selected: int | None) -> None:
        """End `round_` without evaluating it (eval.every): its checkpoint holds the silo's
        state to resume from and no model, so the round cannot be selected. `selected` is as in
        `evaluate_and_commit`."""
        self._select(selected)
        self._checkpoint(round_)

    def select(self, round_: int | None) -> None:
        """After the last round: the driver's final choice of this silo's model (None: none
        yet), published and checkpointed with the silo's last commit."""
        if self._dirty:
            self.restore(self.committed)
        self._select(round_)
        if self._selected is not None and not self._selected_sha256:
            self._publish()
            self._checkpoint(self.committed, self._committed_model())

    def _evaluated_model(self, round_: int) -> dict[str, np.ndarray]:
        """The model `evaluate` just judged as round `round_`'s, as arrays for its checkpoint;
        its figures are kept while it may be selected (the selected round's, and the newest
        checkpoint.KEEP rounds')."""
        assert self._evaluated is not None and self._last is not None
        spare = self._selected.round if self._selected is not None else None
        self._models[round_] = {
            "eval": fields_of(self._last),
            "report": dict(self.algorithm.report()),
        }
        remain = set(sorted(self._models)[-checkpoint.KEEP :]) | {spare}
        self._models = {r: f for r, f in self._models.items() if r in remain}
        return as_arrays(self._evaluated.state_dict())

    def _select(self, round_: int | None) -> None:
        """Round `round_`'s model, written when it was committed, becomes the selected one."""
        if round_ is None or (self._selected is not None and self._selected.round == round_):
            return
        figures = self._models.get(round_)
        if figures is None:
            raise FederationError(f"silo {self.name}: no model of round {round_} to select")
        self._selected = EvalMetrics(**figures["eval"])
        self._selected_report = dict(figures["report"])
        self._selected_sha256 = ""

    def _publish(self, model: dict[str, np.ndarray] | None = None) -> None:
        """Write the selected model (`model`, or as its round's checkpoint holds it) in torch's
        format, with its SHA-256 for the next checkpoint."""
        assert self._selected is not None
        round_ = self._selected.round
        if model is None:
            model = self.store.saved_model(round_)
        self._selected_sha256 = self.store.publish(round_, as_tensors(model))

    def _committed_model(self) -> dict[str, np.ndarray] | None:
        """The model the last commit's checkpoint holds (None: none, as at round 0 or in a
        checkpoint of an older run), to write again with it."""
        return self.store.model_of(self.committed, self.store.load(self.committed))

    @property
    def selected_path(self) -> Path:
        """The file of the selected personalized model's state_dict."""
        if self._selected is None or not self._selected_sha256:
            raise RuntimeError(f"silo {self.name}: no model selected and published yet")
        return self.store.published_path(self._selected.round)

    def outcome(self) -> SiloOutcome:
        """The selected personalized model's scores."""
        if self._selected is None or self._last is None:
            raise RuntimeError(f"silo {self.name}: outcome() before any model was selected")
        return SiloOutcome(
            silo=self.name,
            selected_round=self._selected.round,
            val_accuracy=self._selected.val_accuracy,
            test_accuracy=self._selected.test_accuracy,
            final_test_accuracy=self._last.test_accuracy,
            extras=dict(self._selected_report) if self._model_goes_central else {},
        )

    @property
    def _model_goes_central(self) -> bool:
        """Whether this silo's personalized model goes to the central store (privacy.central_models
        =full, and no store of its own): only then do its figures (APFL's alpha, a part of that
        model) leave the silo with its scores."""
        own = self.cfg.silos.get(self.name)
        return self.cfg.privacy.central_models == "full" and not (own and own.tracking_uri)

    def attach(self, exporters: dict[str, SiloExporter]) -> None:
        """Before round 1: keep the exporters to run at the end; each checks its store now."""
        for exporter in exporters.values():
            exporter.check(self.name)
        self._exporters = dict(exporters)

    def export(self) -> dict[str, dict[str, str]]:
        """Run every attached exporter on the selected personalized model, in this process."""
        if not self._exporters:
            return {}
        model = self.personalized()
        return {key: exporter.export(model) for key, exporter in self._exporters.items()}

    def personalized(self) -> PersonalizedModel:
        """The selected personalized model, with what it takes to answer on raw rows."""
        return PersonalizedModel(
            silo=self.name,
            config=self.cfg,
            state_path=self.selected_path,
            input_shape=self.data.input_shape,
            num_classes=self.num_classes,
            preprocessing=self.data.preprocessing,
            raw_columns=self.data.raw_columns,
            example=input_example(self.cfg.data.source, self.data.raw_columns),
            outcome=self.outcome(),
            val_rows=self.data.validation_digest(),
        )


def _written(tensor: torch.Tensor) -> tuple[Any, int, int]:
    """What changes when a tensor is written or replaced: its identity, its memory, the count
    torch keeps of its in-place writes."""
    return id(tensor), tensor.data_ptr(), tensor._version


def _same_memory(a: np.ndarray, b: np.ndarray) -> bool:
    """Two read-only views of the same bytes, laid out alike."""
    a, b = np.asarray(a), np.asarray(b)
    return (
        not a.flags.writeable
        and not b.flags.writeable
        and a.__array_interface__ == b.__array_interface__
    )


def label_counts(data: SiloData) -> tuple[int, ...]:
    """How many of the silo's training rows carry each class: counts only, never a row."""
    counts = np.bincount(np.asarray(data.y_train, dtype=np.int64), minlength=data.num_classes)
    return tuple(int(c) for c in counts)
