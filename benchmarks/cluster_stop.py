"""How long `cluster/local_cluster.py` takes to stop: from SIGTERM to the script's exit, once
every process it started is gone.

    python benchmarks/cluster_stop.py [--nodes 2] [--repeats 3]

Starts the script with --nodes silo nodes (a head plus one labelled node each), waits for its
info file, sends SIGTERM and times until it exits; the script itself waits for each process it
marked to end (`stop_marked`). Prints each repeat's seconds and the minimum, beside the time
the cluster took to come up, for scale.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from paths import ROOT

START_TIMEOUT_S = 180.0


def once(nodes: int) -> tuple[float, float]:
    """Seconds to come up and seconds to stop, for one cluster."""
    with tempfile.TemporaryDirectory() as tmp:
        info = Path(tmp) / "cluster.json"
        silos = [f"s{i}" for i in range(nodes)]
        command = [sys.executable, str(ROOT / "cluster" / "local_cluster.py"), *silos]
        began = time.monotonic()
        proc = subprocess.Popen(
            [*command, "--info-file", str(info)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            while not (info.exists() and info.read_text().strip()):
                if proc.poll() is not None or time.monotonic() - began > START_TIMEOUT_S:
                    raise SystemExit(f"the cluster did not come up (exit {proc.poll()})")
                time.sleep(0.2)
            up = time.monotonic() - began
            stopping = time.monotonic()
            proc.terminate()
            proc.wait(timeout=120)
            return up, time.monotonic() - stopping
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    runs = [once(args.nodes) for _ in range(args.repeats)]
    for up, stop in runs:
        print(f"up {up:.1f} s, stop {stop:.2f} s")
    fastest = min(stop for _, stop in runs)
    print(f"{args.nodes} silo nodes: stop, minimum of {args.repeats}: {fastest:.2f} s")


if __name__ == "__main__":
    main()
