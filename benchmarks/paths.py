"""The repository's files by absolute path, so that a benchmark runs from any directory."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def in_repo(path: str) -> str:
    """`path`, relative to the repository's root (as the scripts name their jobs), made absolute."""
    return str(ROOT / path)
