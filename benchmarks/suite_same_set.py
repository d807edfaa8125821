"""The test suite's wall time on the same set of tests, before and after: an earlier commit's
suite against this tree's.

    python benchmarks/suite_same_set.py --before c6f2d51 [--order after,before]

Checks the earlier commit out into a git worktree (`--workdir`, kept for the next run) with a
virtual environment of its own, collects both trees' tests, and keeps the test functions
(file::function) that both have: each side runs all of its own parametrizations of them, and
nothing else. Then runs the two sides one after the other, in `--order`, each as
`python -m pytest -q -p no:cacheprovider --durations=0 <its tests>` with its own environment.
Prints one table (pytest's wall time and result per side, and the ratio) and the files whose
time changed most. Run it on a quiet machine: each side takes the suite's time.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from paths import ROOT

SUMMARY = re.compile(r"^=*\s*(\d+ passed.*?) in ([0-9.]+)s")
DURATION = re.compile(r"^([0-9.]+)s (?:call|setup|teardown)\s+(\S+?)::")


def prepared_tree(before: str, workdir: Path) -> Path:
    """A worktree of `before` under `workdir` with its own .venv (reused when there)."""
    tree = workdir / f"tree-{before}"
    if not tree.exists():
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(tree), before], cwd=ROOT, check=True
        )
    python = tree / ".venv" / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(tree / ".venv")], check=True)
        pip = [str(python), "-m", "pip", "install", "--quiet"]
        subprocess.run([*pip, "-e", f"{tree}[test]"], check=True)
    return tree


def collected(tree: Path) -> list[str]:
    """The node ids pytest collects in `tree`, with the tree's own environment."""
    out = subprocess.run(
        [str(tree / ".venv" / "bin" / "python"), "-m", "pytest", "--collect-only", "-q"],
        cwd=tree,
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    return [line for line in out.splitlines() if "::" in line]


def function_of(node: str) -> str:
    """file::function of a node id, without its parameters."""
    return node.split("[", 1)[0]


def run(tree: Path, nodes: list[str], log: Path) -> tuple[str, float, float]:
    """pytest on `nodes` in `tree`: its result line, its own wall time, and the process's."""
    command = [
        str(tree / ".venv" / "bin" / "python"),
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
    ]
    began = time.monotonic()
    with log.open("w") as out:
        subprocess.run([*command, "--durations=0", *nodes], cwd=tree, stdout=out, check=False)
    elapsed = time.monotonic() - began
    for line in reversed(log.read_text().splitlines()):
        if match := SUMMARY.match(line):
            return match.group(1), float(match.group(2)), elapsed
    return "no result line", float("nan"), elapsed


def per_file(log: Path) -> Counter[str]:
    """Seconds per test file from a --durations=0 log."""
    seconds: Counter[str] = Counter()
    for line in log.read_text().splitlines():
        if match := DURATION.match(line):
            seconds[match.group(2)] += float(match.group(1))
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="the earlier commit")
    parser.add_argument("--order", default="before,after", choices=["before,after", "after,before"])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/suite_same_set"))
    parser.add_argument("--files", type=int, default=15, help="files shown in the second table")
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    before = subprocess.run(
        ["git", "rev-parse", "--short", args.before],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    after = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    trees = {"before": prepared_tree(before, args.workdir), "after": ROOT}
    nodes = {side: collected(tree) for side, tree in trees.items()}
    common = {function_of(n) for n in nodes["before"]} & {function_of(n) for n in nodes["after"]}
    chosen = {side: [n for n in ids if function_of(n) in common] for side, ids in nodes.items()}
    results, logs = {}, {}
    for side in args.order.split(","):
        logs[side] = args.workdir / f"{side}.log"
        results[side] = run(trees[side], chosen[side], logs[side])
    print(
        f"\n{len(common)} test functions in both trees ({len(nodes['before'])} tests collected "
        f"before, {len(nodes['after'])} after); order {args.order}\n"
    )
    print("| side | commit | tests run | result | pytest's wall (s) | process wall (s) |")
    print("|---|---|---|---|---|---|")
    for side, commit in (("before", before), ("after", after)):
        line, wall, elapsed = results[side]
        print(f"| {side} | {commit} | {len(chosen[side])} | {line} | {wall:.1f} | {elapsed:.1f} |")
    ratio = results["after"][1] / results["before"][1]
    print(f"\nafter / before: {ratio:.3f} ({100 * (1 - ratio):.1f}% less)\n")
    seconds = {side: per_file(log) for side, log in logs.items()}
    files = set(seconds["before"]) | set(seconds["after"])
    moved = sorted(files, key=lambda f: -abs(seconds["after"][f] - seconds["before"][f]))
    print("| file | before (s) | after (s) | after / before |")
    print("|---|---|---|---|")
    for name in moved[: args.files]:
        b, a = seconds["before"][name], seconds["after"][name]
        print(f"| {name} | {b:.1f} | {a:.1f} | {a / b if b else float('nan'):.2f} |")


if __name__ == "__main__":
    main()
