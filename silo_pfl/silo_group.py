"""Several silos resident in one process, as if each had its own.

Each silo keeps its own model, local keys, optimizer state, directory and exporters (they are
separate `Silo` objects). What a process shares is its global random generators (Python's,
numpy's, torch's): every call into a silo therefore runs with that silo's own generator states,
swapped in before and saved after, so a silo draws exactly the numbers it would draw alone and a
packed run is bit-identical to one with a process per silo. Nothing of one silo is handed to
another: a call names its silo, and only that silo's method runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from silo_pfl.seeding import generators, set_generators
from silo_pfl.settings import from_dict
from silo_pfl.silo import Silo

# The silo methods a caller may invoke through the group: the silo's whole remote API.
API = frozenset(
    {
        "setup",
        "build",
        "fit",
        "evaluate",
        "commit",
        "evaluate_and_commit",
        "commit_unevaluated",
        "select",
        "restore",
        "adopt_sent",
        "check_checkpoint",
        "rejoin",
        "outcome",
        "attach",
        "export",
        "adapt",
        "advertise",
        "share_keys",
        "confirm",
        "unmask",
    }
)


class SiloGroup:
    """The silos named in `names`, each with its own state and random generators."""

    def __init__(self, config: dict[str, Any], names: Sequence[str], run_id: str = "default"):
        if len(set(names)) != len(names) or not names:
            raise ValueError(f"a silo group needs distinct silo names, got {list(names)}")
        cfg = from_dict(config)  # built once: the silos share it, read-only
        self.silos = {name: Silo(cfg, name, run_id) for name in names}
        self._rng: dict[str, tuple[object, object, object]] = {}  # each silo's, between calls

    def call(self, name: str, method: str, *args: Any) -> Any:
        """Run `method` of silo `name` with its own random generators."""
        if method not in API:
            raise AttributeError(f"{method!r} is not part of a silo's API")
        silo = self.silos[name]
        if name in self._rng:
            set_generators(self._rng[name])
        try:
            return getattr(silo, method)(*args)
        finally:
            self._rng[name] = generators()
