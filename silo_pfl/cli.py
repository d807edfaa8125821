"""The command line: `silo-pfl run CONFIG [key=value ...] [--results PATH]`, `silo-pfl models`."""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path

from silo_pfl.errors import ConfigError, SiloPflError

EXIT_USER_ERROR = 2
EXIT_FAILURE = 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="silo-pfl", description=__doc__)
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run a federation from a job YAML")
    run.add_argument("config", help="job YAML, e.g. jobs/heart_disease.yaml")
    run.add_argument("overrides", nargs="*", help="key=value overrides, e.g. rounds=5 seed=1")
    run.add_argument("--results", help="write a JSON summary of the run to this path")
    run.add_argument("--quiet", action="store_true", help="print only the final table")
    run.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks on errors"
    )
    models = commands.add_parser("models", help="list the silos' registered personalized models")
    models.add_argument("--federation", help="only this federation's models")
    models.add_argument(
        "--tracking-uri",
        help="MLflow store; default $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db",
    )
    models.add_argument("--all", action="store_true", help="every version, not only aliased ones")
    models.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks on errors"
    )
    return parser


def _check_results_path(path: str | None) -> None:
    if path is None:
        return
    parent = Path(path).resolve().parent
    if not parent.is_dir():
        raise ConfigError(f"--results {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise ConfigError(f"--results {path}: directory {parent} is not writable")


def _run(args: argparse.Namespace) -> int:
    from silo_pfl.callbacks import Callback, ProgressPrinter
    from silo_pfl.config import load_config
    from silo_pfl.federation import Federation

    config = load_config(args.config, args.overrides)
    _check_results_path(args.results)
    callbacks: list[Callback] = [] if args.quiet else [ProgressPrinter()]
    result = Federation(config, callbacks=callbacks).run()
    if args.quiet:
        ProgressPrinter().on_end(result)
    if args.results:
        result.write_json(args.results)
        print(f"results written to {args.results}")
    tracked = result.extras.get("mlflow")
    if tracked:
        print(
            f"mlflow: run {tracked['run_id']} in experiment {tracked['experiment']} at "
            f"{tracked['tracking_uri']}; models: silo-pfl models --federation {config.name}"
        )
    return 0


def _models(args: argparse.Namespace) -> int:
    from silo_pfl.tracking.listing import models_table

    print(models_table(args.tracking_uri, args.federation, args.all))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    args = _parser().parse_args(argv)
    try:
        return _models(args) if args.command == "models" else _run(args)
    except SiloPflError as exc:
        if args.debug:
            traceback.print_exc()
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR if isinstance(exc, ConfigError) else EXIT_FAILURE
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if args.debug:
            traceback.print_exc()
        print(
            f"error: {type(exc).__name__}: {exc} (run with --debug for the traceback)",
            file=sys.stderr,
        )
        return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
