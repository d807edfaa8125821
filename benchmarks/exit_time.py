"""How long a `silo-pfl` process takes to end once its command is done: from its last atexit
handler to the process's end, with what the CLI loads (torch, Ray, MLflow, the package),
with and without cli.console's gc.freeze, alternately.

    python benchmarks/exit_time.py [--pairs 5]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

LOADED = (
    "import torch, ray, mlflow, silo_pfl.cli, silo_pfl.runtime.orchestrator, "
    "silo_pfl.tracking.tracker, silo_pfl.report.figures"
)
# The handler registered first runs last: it prints when the atexit handlers have all run.
PROGRAM = """
import atexit, gc, sys, time
atexit.register(lambda: print(time.time(), file=sys.stderr, flush=True))
{loaded}
if {freeze}:
    gc.freeze()
"""


def exit_seconds(freeze: bool) -> float:
    """Seconds from the last atexit handler to the end of a fresh process."""
    code = PROGRAM.format(loaded=LOADED, freeze=freeze)
    child = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)
    assert child.stderr is not None
    handlers_done = float(child.stderr.readline())
    if child.wait() != 0:
        sys.exit(f"the child failed: {child.stderr.read()[-2000:]}")
    return time.time() - handlers_done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pairs", type=int, default=5)
    args = parser.parse_args()
    seconds: dict[bool, list[float]] = {False: [], True: []}
    for pair in range(args.pairs):
        for freeze in (False, True) if pair % 2 == 0 else (True, False):
            seconds[freeze].append(exit_seconds(freeze))
    for freeze in (False, True):
        figures = ", ".join(f"{s:.2f}" for s in seconds[freeze])
        label = "gc.freeze  " if freeze else "no freeze  "
        print(f"{label} median {statistics.median(seconds[freeze]):.2f} s ({figures})")
    ratio = statistics.median(seconds[True]) / statistics.median(seconds[False])
    print(f"exit with gc.freeze / without: {ratio:.2f}")


if __name__ == "__main__":
    main()
