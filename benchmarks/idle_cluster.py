"""The CPU that idle services take from the machine: the tests' loopback cluster, one local Ray
node, and the federation's MLflow tracking server with MLflow's job execution on and off.

    python benchmarks/idle_cluster.py [--seconds 15] [--repeats 3]

Samples the CPU time of every process on the machine (/proc), so run it on a quiet machine:
first with nothing started (the baseline), then with each of these up and idle in turn: the test
suite's loopback cluster (`tests/loopback_cluster.py`: `cluster/local_cluster.py`'s head, a node
per hospital and a tracking server), a local Ray as the suite's `ray_local` starts it (one node,
no dashboard), and `cluster/tracking_server.sh` (SQLite store) as it runs by default (job
execution off) and with MLFLOW_SERVER_ENABLE_JOB_EXECUTION=true (MLflow's own default). Prints
one table: the CPU seconds from each start until SETTLE_S after it answered, then the cores it
takes while it does nothing.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import ray
from paths import ROOT

sys.path.insert(0, str(ROOT / "tests"))
import session_ray
from loopback_cluster import start
from processes import stop_group, wait_for_http

SETTLE_S = 30.0  # after a start answered, before sampling: the start's own work is over
TRACKING_PORT = 5097


def machine_cpu_seconds() -> float:
    """User and system CPU seconds of every live process on the machine."""
    ticks = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def idle_cores(seconds: float, repeats: int) -> list[float]:
    """The machine's CPU use, in cores, over `repeats` windows of `seconds`."""
    samples = []
    for _ in range(repeats):
        cpu, began = machine_cpu_seconds(), time.monotonic()
        time.sleep(seconds)
        samples.append((machine_cpu_seconds() - cpu) / (time.monotonic() - began))
    return samples


def measured(name: str, up: Callable[[], Callable[[], None]], args: argparse.Namespace) -> str:
    """A table row: `up()` starts something, returns once it answers, and returns how to stop
    it."""
    cpu = machine_cpu_seconds()
    down = up()
    try:
        time.sleep(SETTLE_S)
        started = machine_cpu_seconds() - cpu
        samples = idle_cores(args.seconds, args.repeats)
    finally:
        down()
    return f"| {name} | {started:.1f} | {min(samples):.3f} | {max(samples):.3f} |"


def loopback_cluster() -> Callable[[], None]:
    running = start(Path(tempfile.mkdtemp(prefix="idle_cluster")))
    next(running)
    return lambda: next(running, None)


def local_ray() -> Callable[[], None]:
    session_ray.start()
    return ray.shutdown


def tracking_server(jobs: str | None) -> Callable[[], Callable[[], None]]:
    """`cluster/tracking_server.sh` in a session of its own, with MLFLOW_SERVER_ENABLE_JOB_EXECUTION
    set to `jobs` (None: the script's default)."""

    def up() -> Callable[[], None]:
        env = {k: v for k, v in os.environ.items() if k != "MLFLOW_SERVER_ENABLE_JOB_EXECUTION"}
        env.update(PORT=str(TRACKING_PORT), MLFLOW_DIR=tempfile.mkdtemp(prefix="idle_mlflow"))
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        if jobs is not None:
            env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = jobs
        log = Path(env["MLFLOW_DIR"]) / "server.log"
        output = log.open("w")
        server = subprocess.Popen(
            ["bash", str(ROOT / "cluster" / "tracking_server.sh")],
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        url = f"http://127.0.0.1:{TRACKING_PORT}/health"
        wait_for_http(url, server, log, "tracking_server.sh", 120)

        def down() -> None:
            stop_group(server, 30)
            output.close()

        return down

    return up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows = [measured("nothing started (baseline)", lambda: lambda: None, args)]
    rows.append(measured("the tests' loopback cluster, idle", loopback_cluster, args))
    rows.append(measured("a local Ray as `ray_local` starts it, idle", local_ray, args))
    rows.append(measured("tracking_server.sh as it runs (jobs off)", tracking_server(None), args))
    jobs_on = tracking_server("true")
    rows.append(measured("tracking_server.sh, MLflow's job execution on", jobs_on, args))
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"\nthe machine's CPU: from each start to {SETTLE_S:g} s after it answered (CPU s), then "
        f"in cores over {args.repeats} windows of {args.seconds:g} s; load average {load}\n"
    )
    print("| running | start-up (CPU s) | idle cores (min) | idle cores (max) |")
    print("|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
