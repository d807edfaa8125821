"""What the benchmark scripts share: their command line, a fresh local Ray, and a federation's
silos and server as plain objects in one process."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
from paths import in_repo

from silo_pfl.callbacks import Callback
from silo_pfl.config import FederationConfig, RayConfig, to_dict
from silo_pfl.data import silo_names
from silo_pfl.errors import ConfigError, SiloPflError
from silo_pfl.results import RoundSummary
from silo_pfl.runtime.session import local_options, quiet_token_notice
from silo_pfl.server import Server
from silo_pfl.server_start import new_server
from silo_pfl.silo import Silo


def job_parser(doc: str, default_job: str | None = None) -> argparse.ArgumentParser:
    """A parser taking a job YAML (optional when `default_job`, a path in the repository, is given)
    and key=value overrides."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    if default_job is None:
        parser.add_argument("job")
    else:
        parser.add_argument("job", nargs="?", default=in_repo(default_job))
    parser.add_argument("overrides", nargs="*", help="key=value overrides")
    return parser


BENCHMARKS = str(Path(__file__).resolve().parent)


def run_main(main: Callable[[], None]) -> None:
    """A script's `main` under the CLI's convention: the project's own errors (a bad setting, a
    run that failed) are one line, `error: ...`, exit 2 for a setting and 1 for a run;
    BENCH_DEBUG=1 keeps the traceback."""
    try:
        main()
    except SiloPflError as exc:
        if os.environ.get("BENCH_DEBUG"):
            raise
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2 if isinstance(exc, ConfigError) else 1)


def start_local_ray() -> None:
    """A fresh local Ray for this process, never a cluster left running on the machine. Its
    workers import this directory's modules too (the actors of `ray_limit.py`)."""
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join([BENCHMARKS, *(p for p in paths if p != BENCHMARKS)])
    with quiet_token_notice():
        ray.init(**local_options(RayConfig()))


def in_process_federation(cfg: FederationConfig) -> tuple[list[Silo], Server]:
    """Every silo of `cfg`, set up and built, and its server, in this process (no Ray)."""
    config = to_dict(cfg)
    silos = [Silo(config, name) for name in silo_names(cfg.data)]
    infos = [silo.setup() for silo in silos]
    classes = max(info.num_classes for info in infos)
    for silo in silos:
        silo.build(infos[0].input_shape, classes)
    return silos, new_server(config, infos[0].input_shape, classes)


class RoundClock(Callback):
    """When the set-up ended (on_start) and when each round ended, its checkpoint included:
    the time between two round ends is all a round costs the run."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.ends: list[float] = []

    def on_start(self, *args: Any) -> None:
        self.ends = [time.perf_counter()]

    def on_round_end(self, summary: RoundSummary) -> None:
        self.ends.append(time.perf_counter())

    def round_seconds(self) -> list[float]:
        """Each round's seconds, round 1 first."""
        return [b - a for a, b in zip(self.ends[:-1], self.ends[1:], strict=True)]

    def startup_seconds(self) -> float:
        """From this clock's creation (just before the run) to the set-up's end."""
        return self.ends[0] - self.started
