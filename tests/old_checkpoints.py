"""Checkpoints as older code wrote them, for the tests that check they are still read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from silo_pfl import checkpoint, checkpoint_format


def save_torch_kind(directory: Path, round_: int, state: dict[str, Any]) -> Path:
    """A checkpoint of torch's kind (torch.save's bytes under a SHA-256), as silos wrote theirs
    before 2026-12-05 and servers before they stopped importing torch."""
    writer = checkpoint_format.Headed(checkpoint_format.MAGIC, checkpoint_format.torch_save, state)
    return checkpoint._write_round(directory, round_, checkpoint.CHECKPOINT, writer)
