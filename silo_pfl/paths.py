"""Directory paths a user gives: checked before anything is written under them."""

from __future__ import annotations

from pathlib import Path

from silo_pfl.errors import ConfigError


def nearest_existing(path: Path) -> Path:
    """`path`, or the nearest of its parents that exists (what a mkdir with parents starts in)."""
    return next(p for p in (path, *path.parents) if p.exists())


def outermost_missing(path: Path) -> Path | None:
    """The outermost of `path` and its parents that a mkdir with parents would make, or None
    if `path` exists: what to remove to undo that mkdir."""
    target = path.resolve()
    existing = nearest_existing(target)
    return None if existing == target else existing / target.relative_to(existing).parts[0]


def check_dir_path(path: Path, shown: str) -> None:
    """A directory, existing or to be made: a one-line ConfigError naming `shown` if it, or the
    parent it would be made in, is a file."""
    existing = nearest_existing(path)
    if not existing.is_dir():
        what = "" if existing == path else f"{existing} "
        raise ConfigError(f"{shown}: {what}is a file, expected a directory")
