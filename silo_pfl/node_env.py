"""Values a silo's node fills in from its own environment: `$NAME` (or `${NAME}`) in a CSV path
(`data.paths`) or in the silo's own store URI (`silos.<name>.tracking_uri`), so that each node
keeps its files and credentials where only it knows them."""

from __future__ import annotations

import os
import re

VARIABLE = re.compile(r"\$\{?(\w+)")  # $NAME or ${NAME}


def names_variables(text: str) -> bool:
    """Whether `text` names an environment variable."""
    return VARIABLE.search(text) is not None


def expand(text: str) -> tuple[str, str | None]:
    """`text` with this process's environment variables filled in (on a silo's node: the node's),
    and the first variable it names that is not set, or None. Only `text` is searched: a value
    may hold a `$` of its own (a password), which names no variable."""
    unset = next((m[1] for m in VARIABLE.finditer(text) if m[1] not in os.environ), None)
    return os.path.expandvars(text), unset


def pin_hint(silo: str) -> str:
    """How to give silo `silo` a variable: where its node starts, with the silo kept there."""
    return (
        "set it where its own node's `ray start` runs, and pin the silo there "
        f"(ray.placement=per_node, or silos.{silo}.node_label)"
    )
