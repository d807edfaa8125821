"""The command line: `silo-pfl run|submit|config CONFIG [key=value ...]`, `onboard`, `jobs`,
`stop`, `models`, `report`, `compare`, `keys init|show`."""

from __future__ import annotations

import argparse
import gc
import os
import shlex
import signal
import sys
import tempfile
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from silo_pfl.compare import add_arguments as compare_arguments
from silo_pfl.errors import ConfigError, SiloPflError, interruption, typed_line

if TYPE_CHECKING:
    from silo_pfl.callbacks import Callback
    from silo_pfl.config import FederationConfig
    from silo_pfl.federation import Federation
    from silo_pfl.results import FederationResult

EXIT_USER_ERROR = 2
EXIT_FAILURE = 1
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what a process the signal ended exits with


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one line (`_usage_error`); --help is unchanged."""

    def error(self, message: str) -> NoReturn:
        _usage_error(self.prog, message)


def _usage_error(prog: str, message: str) -> NoReturn:
    """`error: PROG: MESSAGE (see PROG --help)` on stderr, then exit 2."""
    print(f"error: {prog}: {message} (see {prog} --help)", file=sys.stderr)
    raise SystemExit(EXIT_USER_ERROR)


def _debug(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks on errors"
    )


def _cluster_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--address",
        help="the cluster's Jobs API (dashboard), e.g. http://127.0.0.1:8265; default "
        "$RAY_API_SERVER_ADDRESS, else $RAY_ADDRESS",
    )
    parser.add_argument(
        "--token-file",
        help="the cluster's token (wins over the variables); default $RAY_AUTH_TOKEN, "
        "$RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token",
    )
    _debug(parser)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="silo-pfl", description=__doc__)
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run a federation from a job YAML")
    submit = commands.add_parser("submit", help="submit a federation to a cluster as a Ray Job")
    for command in (run, submit):
        command.add_argument("config", help="job YAML, e.g. jobs/heart_disease.yaml")
        command.add_argument(
            "overrides", nargs="*", default=[], help="key=value overrides, e.g. rounds=5"
        )
        command.add_argument("--results", help="write a JSON summary of the run to this path")
        command.add_argument("--quiet", action="store_true", help="print only the final table")
        command.add_argument(
            "--resume",
            nargs="?",
            const=True,
            default=False,
            metavar="RUN_ID",
            help="continue the latest run of this federation (or RUN_ID) from its last "
            "checkpoint; only rounds= may change",
        )
    run.add_argument("--results-in-log", action="store_true", help=argparse.SUPPRESS)
    _debug(run)
    submit.add_argument("--no-wait", action="store_true", help="print the job id and return")
    submit.add_argument(
        "--onboard",
        metavar="SILO",
        help="instead of a federation, submit SILO's onboarding (silo-pfl onboard --silo SILO): "
        "a new silo joins the trained federation (under ray.placement=per_node, on the node "
        "labelled silo=SILO)",
    )
    _cluster_options(submit)
    onboard = commands.add_parser(
        "onboard", help="a new silo joins a trained federation (cold start)"
    )
    onboard.add_argument("config", help="job YAML giving the new silo's data, e.g. jobs/x.yaml")
    onboard.add_argument(
        "overrides", nargs="*", default=[], help="key=value overrides, e.g. rounds=10"
    )
    onboard.add_argument("--silo", required=True, help="the joining silo, e.g. silo_9")
    for command in (onboard, submit):
        command.add_argument(
            "--from",
            dest="from_run",
            metavar="RUN_ID",
            help="onboarding: the trained federation's MLflow run; default its latest finished run",
        )
        command.add_argument(
            "--no-alone",
            action="store_true",
            help="onboarding: skip the baseline of the silo training alone",
        )
    onboard.add_argument("--results", help="write a JSON summary of the onboarding to this path")
    onboard.add_argument("--quiet", action="store_true", help="print only the final table")
    onboard.add_argument("--results-in-log", action="store_true", help=argparse.SUPPRESS)
    _debug(onboard)
    config = commands.add_parser(
        "config", help="print a job's fully resolved config, every default included (YAML)"
    )
    config.add_argument("config", help="job YAML, e.g. jobs/heart_disease.yaml")
    config.add_argument(
        "overrides", nargs="*", default=[], help="key=value overrides, e.g. rounds=5"
    )
    _debug(config)
    jobs = commands.add_parser("jobs", help="list the cluster's recent jobs")
    jobs.add_argument("--limit", type=int, default=20, help="how many, newest first (default 20)")
    _cluster_options(jobs)
    stop = commands.add_parser("stop", help="stop a job on the cluster")
    stop.add_argument("job_id", help="the id `silo-pfl submit` printed")
    _cluster_options(stop)
    models = commands.add_parser("models", help="list the silos' registered personalized models")
    models.add_argument("--federation", help="only this federation's models")
    models.add_argument(
        "--tracking-uri",
        help="MLflow store; default $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db",
    )
    models.add_argument("--all", action="store_true", help="every version, not only aliased ones")
    models.add_argument(
        "--local",
        metavar="DIR",
        help="list instead the models kept in silos' own directories under DIR (e.g. a node's "
        "output_dir; privacy.central_models=global_only or none)",
    )
    _debug(models)
    report = commands.add_parser(
        "report", help="a tracked run's HTML report with figures, also logged to the run"
    )
    report.add_argument("run_id", metavar="RUN_ID", help="the federation's MLflow parent run")
    report.add_argument(
        "--against",
        metavar="RUN_ID",
        help="another run of the same federation (e.g. fedavg or local): each silo's gain",
    )
    report.add_argument(
        "--out", help="directory for report.html and its PNGs; default reports/RUN_ID"
    )
    report.add_argument(
        "--tracking-uri",
        help="MLflow store; default $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db",
    )
    report.add_argument(
        "--no-log", action="store_true", help="do not (re)log the report to the run's artifacts"
    )
    _debug(report)
    compare = commands.add_parser("compare", help="every algorithm on several jobs: tables, JSON")
    compare_arguments(compare)
    _debug(compare)
    keys = commands.add_parser(
        "keys", help="a silo's identity key for secure aggregation, on the silo's own node"
    )
    keys.add_argument("action", choices=("init", "show"), help="init: create it; show: print it")
    keys.add_argument("--federation", required=True, help="the federation's name")
    keys.add_argument("--silo", required=True, help="this node's silo")
    keys.add_argument(
        "--key-dir",
        help="where the key lives (silos.<silo>.key_dir); default ~/.silo_pfl/keys/FEDERATION/SILO",
    )
    _debug(keys)
    return parser


# Options whose empty value (an unset shell variable's) would otherwise read as not given, and
# silently pick the default: a store in the working directory, the latest run, every federation.
BLANK_REFUSED = {
    "tracking_uri": "--tracking-uri",
    "against": "--against",
    "local": "--local",
    "from_run": "--from",
    "onboard": "--onboard",
    "address": "--address",
    "token_file": "--token-file",
}


def _resume_before_job(argv: list[str]) -> list[str]:
    """`run --resume jobs/x.yaml`: --resume's optional RUN_ID would take the job's path, and the
    job would be missing. A YAML path right after --resume is the job; --resume moves last."""
    at = argv.index("--resume") if "--resume" in argv else -1
    if 0 <= at < len(argv) - 1 and argv[at + 1].endswith((".yaml", ".yml")):
        return [*argv[:at], *argv[at + 1 :], "--resume"]
    return argv


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse the command line; key=value overrides may also follow the options."""
    parser = _parser()
    argv = _resume_before_job(list(sys.argv[1:] if argv is None else argv))
    args, extra = parser.parse_known_args(argv)
    late = [item for item in extra if "=" in item and not item.startswith("-")]
    if extra != late or (late and args.command not in ("run", "submit", "onboard", "config")):
        _usage_error(f"{parser.prog} {args.command}", f"unrecognized arguments: {' '.join(extra)}")
    if isinstance(getattr(args, "config", None), str) and not args.config.strip():
        _usage_error(f"{parser.prog} {args.command}", "CONFIG: got '', expected a YAML file's path")
    for dest, option in BLANK_REFUSED.items():
        value = getattr(args, dest, None)
        if isinstance(value, str) and not value.strip():
            _usage_error(
                f"{parser.prog} {args.command}",
                f"{option}: got {value!r}, expected a value, or no {option} for the default",
            )
    if isinstance(getattr(args, "resume", None), str) and "=" in args.resume:
        late, args.resume = [args.resume, *late], True  # `--resume rounds=9`: an override
    if isinstance(getattr(args, "resume", None), str):
        from silo_pfl.run_dir import check_run_id

        try:
            check_run_id(args.resume)
        except ConfigError as error:
            _usage_error(f"{parser.prog} {args.command}", str(error))
    if late:
        args.overrides = [*args.overrides, *late]
    return args


def _check_results_path(path: str | None, config: str | None = None) -> None:
    """--results must name a file that can be written, before anything runs, and not the job's
    `config` (a slip of the shell would overwrite the job with its results)."""
    if path is None:
        return
    if not path.strip():
        raise ConfigError(f"--results: got {path!r}, expected a file path")
    if config is not None and Path(path).resolve() == Path(config).resolve():
        raise ConfigError(f"--results {path}: is the job's config file; name another path")
    if Path(path).is_dir() or path.endswith(os.sep):
        raise ConfigError(f"--results {path}: is a directory, expected a file path")
    parent = Path(path).resolve().parent
    if not parent.is_dir():
        raise ConfigError(f"--results {path}: directory {parent} does not exist")
    try:  # as the results will be written: a temporary file beside it (results.write_json_atomic)
        fd, probe = tempfile.mkstemp(dir=parent, prefix=f".{Path(path).name}.", suffix=".tmp")
    except OSError as exc:
        raise ConfigError(
            f"--results {path}: cannot write in directory {parent} ({exc.strerror})"
        ) from None
    os.close(fd)
    os.unlink(probe)


def _run(args: argparse.Namespace) -> int:
    from silo_pfl.runtime.jobs import config_file

    with config_file(args.config) as args.config:  # a submitted job's, given inline
        return _run_config(args)


def _run_config(args: argparse.Namespace) -> int:
    from silo_pfl.config import merge_config, read_yaml
    from silo_pfl.progress import ProgressPrinter
    from silo_pfl.runtime.session import ray_session_while
    from silo_pfl.stop_signals import sigterm_interrupts_unless_set

    draft = merge_config(read_yaml(Path(args.config)), args.overrides)
    _check_results_path(args.results, args.config)
    callbacks: list[Callback] = [] if args.quiet else [ProgressPrinter()]
    with ray_session_while(draft, lambda: _loaded(args, callbacks)) as federation:
        result = federation.run(resume=args.resume)
    with sigterm_interrupts_unless_set():  # Ray's session has ended: SIGTERM still stops
        _ran(args, federation.config, result)
    return 0


def _ran(args: argparse.Namespace, config: FederationConfig, result: FederationResult) -> None:
    """What `run` prints and writes once the run has ended."""
    from silo_pfl.progress import ProgressPrinter
    from silo_pfl.runtime.jobs import print_results_line

    if args.quiet:
        ProgressPrinter().on_end(result)
    if args.results:
        result.write_json(args.results)
        print(f"results written to {args.results}")
    if args.results_in_log:
        print_results_line(result.to_dict())
    tracked = result.extras.get("mlflow")
    if tracked:
        print(
            f"mlflow: run {tracked['run_id']} in experiment {tracked['experiment']} at "
            f"{tracked['tracking_uri']}; models: "
            f"{models_hint(config, tracked['tracking_uri'], list(result.silos))}"
        )
    print(f"run {result.run_id}: {result.run_dir}")


def models_hint(config: FederationConfig, central_uri: str, silos: Sequence[str]) -> str:
    """The command that lists a finished run's models: the central store's, else each silo's
    own directory; and for each of `silos` with a store of its own, that store's (as
    configured: its $VARS are filled in on the silo's node, where the command is then run)."""
    from silo_pfl.tracking.uri import redact

    listing = ["silo-pfl", "models", "--federation", config.name]
    settings = {silo: config.silos.get(silo) for silo in silos}
    own = {silo: c.tracking_uri for silo, c in settings.items() if c and c.tracking_uri}
    kept = ["silo-pfl", "models", "--local", str(Path(config.output_dir).resolve())]
    hint = (
        shlex.join([*listing, "--tracking-uri", central_uri])
        if config.privacy.central_models == "full"
        else f"kept by each silo ({shlex.join(kept)})"
    )
    if own and len(own) == len(silos):
        hint = "none in the central store"
    for silo, uri in own.items():
        command = shlex.join([*listing, "--tracking-uri", redact(str(uri))])
        hint += f"; {silo}'s in its own store ({command}, on its node)"
    return hint


def _loaded(args: argparse.Namespace, callbacks: list[Callback]) -> Federation:
    """What `_run` does while Ray starts: the run's Federation, its config loaded and checked
    against every registry, which imports torch, the algorithms and the runtime; and, when the
    run is tracked, MLflow's import, which the run's first step needs."""
    from silo_pfl.federation import Federation
    from silo_pfl.settings import load_config

    federation = Federation(load_config(args.config, args.overrides), callbacks=callbacks)
    if federation.config.tracking.enabled:
        import silo_pfl.tracking.tracker  # noqa: F401
    return federation


def _onboard(args: argparse.Namespace) -> int:
    from silo_pfl.runtime.jobs import config_file

    with config_file(args.config) as args.config:  # a submitted onboarding's, given inline
        return _onboard_config(args)


def _onboard_config(args: argparse.Namespace) -> int:
    from silo_pfl.federation import Federation
    from silo_pfl.progress import ProgressPrinter
    from silo_pfl.runtime.jobs import print_results_line

    if not args.silo.strip():
        raise ConfigError(f"--silo: got {args.silo!r}, expected the joining silo's name")
    callbacks: list[Callback] = [] if args.quiet else [ProgressPrinter()]
    federation = Federation(args.config, args.overrides, callbacks=callbacks)
    _check_results_path(args.results, args.config)
    result = federation.onboard(args.silo, args.from_run, alone=not args.no_alone)
    if args.quiet:
        ProgressPrinter().on_end(result)
    report = result.extras["onboard"]
    line = (
        f"{args.silo} joined run {report['trained_run_id']}: test accuracy "
        f"{report['test_accuracy']:.4f}, founders' mean {report['founders_mean_test_accuracy']:.4f}"
        f" ({100 * report['share_of_founders_mean']:.1f}%)"
    )
    if "alone_test_accuracy" in report:
        line += (
            f", alone {report['alone_test_accuracy']:.4f} "
            f"(gain {100 * report['gain_over_alone']:+.1f} points)"
        )
    print(line)
    if args.results:
        result.write_json(args.results)
        print(f"results written to {args.results}")
    if args.results_in_log:
        print_results_line(result.to_dict())
    tracked = result.extras.get("mlflow", {})
    for silo, uri in tracked.get("models", {}).items():
        print(f"mlflow: {silo}'s model {uri}, run {tracked['run_id']}")
    return 0


def _submit(args: argparse.Namespace) -> int:
    from silo_pfl.results import write_json_atomic
    from silo_pfl.runtime.jobs import JobsClient, check_tracking_store, output_dir_note
    from silo_pfl.settings import check_files_apart, check_node_variables, load_config

    onboarding = _onboarding_options(args)
    config = load_config(args.config, args.overrides)
    if args.onboard is not None:
        from silo_pfl.onboarding import check_onboarding

        check_onboarding(config, args.onboard)
    check_node_variables(config, on_cluster=True)
    check_files_apart(config, on_cluster=True)
    check_tracking_store(Path(args.config), args.overrides, config.tracking.enabled)
    note = output_dir_note(config.output_dir, args.resume)
    _check_results_path(args.results, args.config)
    if args.results and args.no_wait:
        raise ConfigError("--results: needs the job's end; drop --no-wait")
    client = JobsClient(args.address, args.token_file)
    job_id = client.submit(
        Path(args.config),
        args.overrides,
        config.name,
        args.quiet,
        args.resume,
        config.plugins,
        onboarding,
    )
    print(f"submitted job {job_id} to {client.address}", flush=True)
    if note:
        print(f"warning: {note}", file=sys.stderr, flush=True)
    if args.no_wait:
        return 0
    try:
        status = client.follow(job_id, sys.stdout)
    except KeyboardInterrupt:
        how = [job_id] + (["--address", args.address] if args.address else [])
        how += ["--token-file", args.token_file] if args.token_file else []
        print(
            f"\njob {job_id} goes on; stop it with: silo-pfl stop {shlex.join(how)}",
            file=sys.stderr,
        )
        return 130
    if status != "SUCCEEDED":
        reason = client.message(job_id)
        print(f"error: job {job_id} {status}" + (f": {reason}" if reason else ""), file=sys.stderr)
        return EXIT_FAILURE
    if args.results:
        write_json_atomic(args.results, client.results(job_id))
        print(f"results written to {args.results}")
    print(f"job {job_id} SUCCEEDED")
    return 0


def _onboarding_options(args: argparse.Namespace) -> list[str]:
    """`silo-pfl onboard`'s options for a submitted onboarding (`submit --onboard SILO`); none
    for a federation, which takes neither --from nor --no-alone."""
    if args.onboard is None:
        for given, option in ((args.from_run, "--from"), (args.no_alone, "--no-alone")):
            if given:
                raise ConfigError(f"{option}: an onboarding's option; give --onboard SILO too")
        return []
    if args.resume is not False:
        raise ConfigError("--resume: an onboarding cannot be resumed; drop --resume or --onboard")
    options = ["--silo", args.onboard]
    options += ["--from", args.from_run] if args.from_run is not None else []
    return options + (["--no-alone"] if args.no_alone else [])


def _config(args: argparse.Namespace) -> int:
    from omegaconf import OmegaConf

    from silo_pfl.config_errors import as_literal
    from silo_pfl.settings import load_config, resolved_config

    config = resolved_config(load_config(args.config, args.overrides))
    print(OmegaConf.to_yaml(as_literal(config)), end="")  # as a job reads it back
    return 0


def _jobs(args: argparse.Namespace) -> int:
    from silo_pfl.runtime.jobs import JobsClient, jobs_table

    if args.limit < 1:
        raise ConfigError(f"--limit: got {args.limit}, expected an integer >= 1")
    print(jobs_table(JobsClient(args.address, args.token_file).list(args.limit)))
    return 0


def _stop(args: argparse.Namespace) -> int:
    from silo_pfl.runtime.jobs import JobsClient

    stopped = JobsClient(args.address, args.token_file).stop(args.job_id)
    print(f"job {args.job_id}: " + ("stopping" if stopped else "had already ended"))
    return 0


def _models(args: argparse.Namespace) -> int:
    from silo_pfl.tracking.listing import local_models_table, models_table

    if args.federation is not None and not args.federation.strip():
        raise ConfigError(f"--federation: got {args.federation!r}, expected a federation's name")
    if args.local:
        print(local_models_table(args.local, args.federation))
    else:
        print(models_table(args.tracking_uri, args.federation, args.all))
    return 0


def _report(args: argparse.Namespace) -> int:
    from silo_pfl.report.command import report

    page = report(args.run_id, args.against, args.out, args.tracking_uri, log=not args.no_log)
    logged = "" if args.no_log else f"; logged to run {args.run_id}'s artifacts under report/"
    print(f"report written to {page}{logged}")
    return 0


def _compare(args: argparse.Namespace) -> int:
    from silo_pfl.compare import main as compare_main

    return compare_main(args)


def _keys(args: argparse.Namespace) -> int:
    """`keys init` makes this silo's identity key, `keys show` prints its public half."""
    from silo_pfl.config import check_name
    from silo_pfl.paths import check_dir_path
    from silo_pfl.secure import identity

    check_name(args.federation, "--federation")
    check_name(args.silo, "--silo")
    if args.key_dir is not None and not args.key_dir.strip():
        raise ConfigError(f"--key-dir: got {args.key_dir!r}, expected a directory path")
    try:
        directory = (
            Path(args.key_dir).expanduser()
            if args.key_dir
            else identity.default_key_dir(args.federation, args.silo)
        )
    except RuntimeError as exc:  # ~user with no such user, or no home directory
        shown = args.key_dir or "(its default, under ~/.silo_pfl/keys)"
        raise ConfigError(f"--key-dir: {shown}: {exc}") from None
    options = ["--federation", args.federation, "--silo", args.silo]
    where = shlex.join(options + (["--key-dir", args.key_dir] if args.key_dir else []))
    check_dir_path(directory, f"--key-dir {args.key_dir}" if args.key_dir else str(directory))
    if args.action == "init":
        key = identity.create(directory, f"silo-pfl keys show {where}")
        print(f"created {directory / identity.PRIVATE_FILE}; its public key, for the config:")
    else:
        key = identity.load(directory, f"silo-pfl keys init {where}")
    public = identity.encode_public(identity.public_bytes(key))
    print(f"silos.{args.silo}.identity_key={public}")
    return 0


COMMANDS = {
    "run": _run,
    "onboard": _onboard,
    "submit": _submit,
    "config": _config,
    "jobs": _jobs,
    "stop": _stop,
    "models": _models,
    "report": _report,
    "compare": _compare,
    "keys": _keys,
}


def _stdout_gone() -> int:
    """stdout's reader has gone (`silo-pfl models | head -1`): end quietly, as SIGPIPE would.

    stdout is pointed at os.devnull, so that the interpreter's flush at exit does not fail again
    on what is still buffered; returns EXIT_BROKEN_PIPE.
    """
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # stdout is no file (replaced in-process): nothing to flush
        pass
    return EXIT_BROKEN_PIPE


def main(argv: Sequence[str] | None = None, process_exits: bool = False) -> int:
    """Entry point; returns the process exit code. `process_exits`: the process ends after this
    (the console command), so once interrupted it ignores further Ctrl-C and SIGTERM, which
    would otherwise end it by the signal, its last line said or not."""
    try:
        args = _parse(argv)
    except SystemExit as exc:  # --help (0), or a usage error already said in one line (2)
        return exc.code if isinstance(exc.code, int) else EXIT_USER_ERROR
    try:
        return COMMANDS[args.command](args)
    except BrokenPipeError:
        return _stdout_gone()
    except SiloPflError as exc:
        if args.debug:
            traceback.print_exc()
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR if isinstance(exc, ConfigError) else EXIT_FAILURE
    except KeyboardInterrupt as exc:
        if process_exits:
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, signal.SIG_IGN)
        if args.debug:
            traceback.print_exc()
        from silo_pfl.stop_signals import cause

        stopped = interruption(exc, cause(exc))
        print(f"error: {stopped}", file=sys.stderr)
        return stopped.exit_code
    except Exception as exc:
        if args.debug:
            traceback.print_exc()
        print(
            f"error: {typed_line(exc)} (run with --debug for the traceback)",
            file=sys.stderr,
        )
        return EXIT_FAILURE


def console() -> None:
    """The `silo-pfl` command and `python -m silo_pfl`: `main`, then exit with its code. What is
    left in memory is frozen first (gc.freeze), so that the interpreter's last collections at
    exit do not walk it: with torch, Ray and MLflow loaded that saves about a second per command
    (docs/BENCHMARKS.md). Finalizers and atexit handlers run as usual."""
    code = main(process_exits=True)
    try:  # what is still buffered, now rather than in the interpreter's flush at exit
        sys.stdout.flush()
    except BrokenPipeError:
        code = _stdout_gone()
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    console()
