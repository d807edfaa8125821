"""A silo's directory on its own node, and what each file in it holds.

- CHECKPOINTS: a checkpoint per committed round (`checkpoint.save_arrays`): the state to resume
  from and the round's personalized model, which selection may still choose.
- GLOBAL_PART: the global keys of a round's model, when they are large (GLOBAL_PART_BYTES or
  more), in a file of their own, which the silos of one worker holding the same bytes share as
  hard links (`checkpoint.save_shared`). The checkpoint then holds the rest, the part's digest
  and the key order.
- SELECTED: the selected personalized model, published in torch's format (as MLflow serves it);
  its SHA-256 goes into the silo's next checkpoint.
- MODELS: read only, each committed round's model in a file of its own, as earlier versions
  wrote them.
- SENT: the algorithm's state as a fit left it, for the algorithms whose server mirrors it
  (`Algorithm.server_mirrors_state`), written before the update leaves the silo: a silo that
  dies after its update was aggregated, before it committed the round, takes it back.

What goes into a checkpoint, and when, is the silo's; where it goes and how it is read back is
this module's.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np

from silo_pfl import checkpoint
from silo_pfl.split import Split

CHECKPOINTS = "checkpoints"
GLOBAL_PART = "checkpoints-global"
GLOBAL_PART_BYTES = 1 << 20
MODELS = "models"
SELECTED = "selected"
SENT = "sent"


class SiloStore:
    """The files of one silo's directory (`run_dir.silo_dir`)."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory

    def start_fresh(self) -> None:
        """A fresh run: whatever an earlier run left in the directory is removed. The directory
        itself is made by the first file written into it (round 0's checkpoint, in `build`), so
        that a run whose set-up fails, at this silo or another, leaves nothing on this node."""
        if self.dir.exists():
            shutil.rmtree(self.dir)

    def rounds(self) -> list[int]:
        """The rounds with a checkpoint, oldest first."""
        return checkpoint.rounds(self.dir / CHECKPOINTS)

    def save(
        self,
        round_: int,
        saved: dict[str, Any],
        model: dict[str, np.ndarray] | None,
        split: Split,
        spare: int | None,
    ) -> None:
        """Checkpoint `round_`: `saved`, with `model`, the round's personalized model, if given.
        `spare`: a round kept beyond checkpoint.KEEP (the selected one, which holds its model)."""
        if model is not None:
            saved = {**saved, **self._model_parts(round_, model, split, spare)}
        checkpoint.save_arrays(self.dir / CHECKPOINTS, round_, saved, spare)

    def _model_parts(
        self, round_: int, model: dict[str, np.ndarray], split: Split, spare: int | None
    ) -> dict[str, Any]:
        """A round's model as its checkpoint holds it: whole, or, where its global keys are
        large, those in a GLOBAL_PART file (written once for all the silos of a worker whose
        model holds the same global keys, as when each evaluates the federation's global state
        with its own local keys) and the rest, with the key order."""
        if split.global_bytes < GLOBAL_PART_BYTES:
            return {"model": model}
        shared_keys = set(split.global_keys)
        shared = {k: v for k, v in model.items() if k in shared_keys}
        digest = checkpoint.save_shared(self.dir / GLOBAL_PART, round_, shared, spare)
        return {
            "model": {k: v for k, v in model.items() if k not in shared_keys},
            "model_global": digest,
            "model_keys": list(model),
        }

    def load(self, round_: int) -> Any:
        """The checkpoint of `round_`, verified."""
        return checkpoint.load(self.dir / CHECKPOINTS, round_)

    def model_of(self, round_: int, saved: dict[str, Any]) -> dict[str, np.ndarray] | None:
        """The model a checkpoint of `round_` holds (None: none), whole again."""
        model = saved.get("model")
        if model is None or "model_global" not in saved:
            return model
        shared = checkpoint.load_shared(self.dir / GLOBAL_PART, round_, saved["model_global"])
        return {k: model[k] if k in model else shared[k] for k in saved["model_keys"]}

    def saved_model(self, round_: int) -> dict[str, np.ndarray]:
        """Round `round_`'s model as committed: in its checkpoint, or in a file of its own where
        an older run wrote it (MODELS), its checkpoint holding none or pruned."""
        older = self.dir / MODELS
        if older.is_dir() and round_ not in self.rounds():
            return checkpoint.load(older, round_)
        model = self.model_of(round_, self.load(round_))
        return model if model is not None else checkpoint.load(older, round_)

    def save_sent(self, round_: int, attempt: int, state: dict[str, np.ndarray]) -> None:
        """Keep the algorithm's `state` as the fit of `round_`, attempt `attempt`, left it."""
        saved = {"round": round_, "attempt": attempt, "state": state}  # load checks the round
        checkpoint.save_arrays(self.dir / SENT, round_, saved)

    def load_sent(self, round_: int, attempt: int) -> dict[str, np.ndarray]:
        """The state `save_sent` kept for `round_`; raises if it was another attempt's."""
        sent = checkpoint.load(self.dir / SENT, round_)
        if sent["attempt"] != attempt:
            raise checkpoint.CheckpointError(
                f"{self.dir / SENT}: round {round_} holds attempt {sent['attempt']}, "
                f"not {attempt}, whose update was aggregated"
            )
        return sent["state"]

    def publish(self, round_: int, state: dict[str, Any]) -> str:
        """Write round `round_`'s model as the selected one, in torch's format; its SHA-256."""
        return checkpoint.save_model(self.dir / SELECTED, round_, state)

    def check_published(self, round_: int, sha256: str) -> None:
        """Raise if the published model of `round_` is missing or is not the one of `sha256`."""
        checkpoint.load(self.dir / SELECTED, round_, sha256)

    def published_path(self, round_: int) -> Path:
        """The file of round `round_`'s published model."""
        return checkpoint.path_of(self.dir / SELECTED, round_, checkpoint.MODEL)
