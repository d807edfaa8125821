"""Rules of the code's shape that a review would otherwise have to catch: config.py holds only
structure (no registry imports), and the parts every algorithm shares never branch on one."""

from __future__ import annotations

import ast
from pathlib import Path

import silo_pfl
from silo_pfl import builtin_names
from silo_pfl.algorithms import ALGORITHMS
from silo_pfl.models import MODELS

PACKAGE = Path(silo_pfl.__file__).parent
SHARED = [
    "silo.py",
    "server.py",
    "strategy.py",
    "training.py",
    *["runtime/" + p.name for p in (PACKAGE / "runtime").glob("*.py")],
]


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return found


def test_config_imports_neither_the_algorithms_nor_the_data_sources():
    imported = _imports(PACKAGE / "config.py")
    assert not {m for m in imported if m.startswith(("silo_pfl.algorithms", "silo_pfl.data"))}


def test_the_builtin_names_the_config_checks_first_are_the_registries():
    """config.check_ranges refuses names outside builtin_names before torch is imported; the
    registries decide. Plugins loaded by other tests may have added algorithms: only the
    package's own count."""
    own = {n for n, cls in ALGORITHMS.items() if cls.__module__.startswith("silo_pfl.algorithms.")}
    assert set(builtin_names.ALGORITHMS) == own
    assert set(builtin_names.MODELS) == set(MODELS)
    assert not {m for m in _imports(PACKAGE / "builtin_names.py") if "__future__" not in m}


def test_the_silo_server_and_orchestrator_never_name_an_algorithm():
    """No comparison with a registered algorithm's name (`if name == "ditto"`, `in ("a", "b")`,
    `case "ditto"`), and no import of one algorithm's module, in the code every algorithm shares."""
    names = set(ALGORITHMS)
    assert {"fedavg", "scaffold", "ditto"} <= names
    for relative in SHARED:
        path = PACKAGE / relative
        tree = ast.parse(path.read_text())
        compared = [
            operand
            for node in ast.walk(tree)
            if isinstance(node, ast.Compare)
            for operand in (node.left, *node.comparators)
        ] + [node.value for node in ast.walk(tree) if isinstance(node, ast.MatchValue)]
        constants = {
            leaf.value
            for operand in compared
            for leaf in ast.walk(operand)
            if isinstance(leaf, ast.Constant) and isinstance(leaf.value, str)
        }
        assert not constants & names, f"{relative} names {sorted(constants & names)}"
        single = {m for m in _imports(path) if m.startswith("silo_pfl.algorithms.")}
        assert single <= {"silo_pfl.algorithms.base", "silo_pfl.algorithms.build_algorithm"} | {
            f"silo_pfl.algorithms.base.{n}" for n in ("Phase", "Algorithm")
        }, f"{relative} imports {sorted(single)}"
