"""What the benchmark scripts share: their command line and a fresh local Ray."""

from __future__ import annotations

import argparse
import logging

import ray


def job_parser(doc: str, default_job: str | None = None) -> argparse.ArgumentParser:
    """A parser taking a job YAML (optional when `default_job` is given) and key=value overrides."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    if default_job is None:
        parser.add_argument("job")
    else:
        parser.add_argument("job", nargs="?", default=default_job)
    parser.add_argument("overrides", nargs="*", help="key=value overrides")
    return parser


def start_local_ray() -> None:
    """A fresh local Ray for this process, never a cluster left running on the machine."""
    ray.init(
        address="local", include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING
    )
