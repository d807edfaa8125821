"""Federations as Ray Jobs: submit, follow, list and stop them through Ray's Jobs API.

The Jobs API is the cluster's dashboard address (http://HOST:8265), not `ray.address`. A
submission ships the silo_pfl package and the plugins' code (`py_modules`) and runs
`python -m silo_pfl run base64:<the job's YAML> key=value ...` on the cluster: the YAML travels
in the entrypoint, to the driver alone, never in a `working_dir`, which Ray unpacks on every node
that runs a worker of the job (each institution's disk would hold the other silos' paths and
stores). The run's driver joins the cluster through the RAY_ADDRESS that Ray sets for it. Every
request carries the cluster's token.
"""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import json
import logging
import os
import re
import secrets
import shlex
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from silo_pfl.errors import ConfigError, FederationError, one_line

JOB_FILE = "job.yaml"
INLINE_CONFIG = "base64:"  # a config given inline, in the entrypoint: `submit`'s, to the driver


@contextmanager
def config_file(config: str) -> Iterator[str]:
    """The path of `config`: itself, or, for a config given inline (INLINE_CONFIG), a file of
    its own (JOB_FILE) in a private temporary directory, removed when the block ends."""
    if not config.startswith(INLINE_CONFIG):
        yield config
        return
    try:
        text = base64.b64decode(config.removeprefix(INLINE_CONFIG), validate=True)
    except ValueError:
        raise ConfigError(f"config {config[:40]}...: not base64, as submit writes it") from None
    with tempfile.TemporaryDirectory(prefix="silo-pfl-job-") as private:
        path = Path(private) / JOB_FILE
        path.write_bytes(text)
        yield str(path)


# The line a run prints with --results-in-log; `submit --results` reads it back from the logs.
RESULTS_MARKER = "silo-pfl-results: "
ADDRESS_VARS = ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS")
TOKEN_VAR, TOKEN_PATH_VAR = "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
METADATA_KEY = "silo_pfl.federation"
POLL_SECONDS = 1.0
QUIET_LOGGERS = (
    "ray.dashboard.modules.dashboard_sdk",
    "ray.dashboard.modules.job.sdk",
    "ray._private.runtime_env.packaging",
)


def address_key(address: str | None) -> str:
    """Where the Jobs API address comes from: --address, else the first of ADDRESS_VARS set."""
    if address:
        return "--address"
    return next((v for v in ADDRESS_VARS if os.environ.get(v)), "--address")


def jobs_address(address: str | None) -> str:
    """--address, else $RAY_API_SERVER_ADDRESS, else $RAY_ADDRESS (as Ray's CLI), as http://."""
    key = address_key(address)
    chosen = address or os.environ.get(key)
    if not chosen:
        raise ConfigError(
            "--address: no Jobs API address; give --address http://HOST:8265 (the cluster's "
            "dashboard) or set RAY_API_SERVER_ADDRESS"
        )
    if chosen == "auto" or chosen.startswith("ray://"):
        raise ConfigError(
            f"{key}: got {chosen!r}, expected the Jobs API (dashboard) address, e.g. "
            "http://127.0.0.1:8265"
        )
    return chosen if "://" in chosen else f"http://{chosen}"


DEFAULT_TOKEN_FILE = "~/.ray/auth_token"


@contextmanager
def _without(names: Sequence[str]) -> Iterator[None]:
    """The environment without `names` while inside. Ray's Jobs client takes RAY_API_SERVER_ADDRESS
    or RAY_ADDRESS over the address it is given, and dials a GCS such a variable names for tens
    of seconds: the address `jobs_address` chose from them (or --address) must be the only one."""
    saved = {name: os.environ.pop(name) for name in names if name in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def token_source(token_file: str | None = None) -> tuple[str, Path | None]:
    """Where this client's token comes from, named as a user would name it: --token-file F
    given on purpose, else as Ray's clients look ($RAY_AUTH_TOKEN, $RAY_AUTH_TOKEN_PATH=F, the
    default file); and its file (None for the variable)."""
    if token_file:
        return f"--token-file {token_file}", Path(token_file).expanduser()
    if os.environ.get(TOKEN_VAR):
        return TOKEN_VAR, None
    if os.environ.get(TOKEN_PATH_VAR):
        named = os.environ[TOKEN_PATH_VAR]
        return f"{TOKEN_PATH_VAR}={named}", Path(named).expanduser()
    return DEFAULT_TOKEN_FILE, Path(DEFAULT_TOKEN_FILE).expanduser()


def auth_token(token_file: str | None = None) -> str | None:
    """The token where `token_source` says; a file named on purpose must be there, the default
    one need not."""
    source, path = token_source(token_file)
    if path is None:
        return os.environ[TOKEN_VAR].strip()
    if not path.is_file():
        if source == DEFAULT_TOKEN_FILE and not path.exists():
            return None
        raise ConfigError(f"{source}: {'not a file' if path.exists() else 'not found'}")
    try:
        return path.read_text(encoding="utf-8").strip()
    except UnicodeDecodeError:
        raise ConfigError(f"{source}: not a UTF-8 text file (a token is one line)") from None
    except OSError as exc:
        raise ConfigError(f"{source}: cannot be read ({exc.strerror or exc})") from None


def check_tracking_store(config: Path, overrides: Sequence[str], tracking_enabled: bool) -> None:
    """A job on a cluster must name its tracking store: the default SQLite file would be made in
    the job's temporary directory on the head node, and vanish with it."""
    from omegaconf import OmegaConf

    if not tracking_enabled or any(o.startswith("tracking.uri=") for o in overrides):
        return
    if OmegaConf.select(OmegaConf.load(config), "tracking.uri") is None:
        raise ConfigError(
            "tracking.uri: a federation submitted to a cluster needs a tracking server that every "
            "node reaches, e.g. tracking.uri=http://HOST:5000 (the default SQLite file would live "
            "in the job's temporary directory); or tracking.enabled=false"
        )


def identity_key_overrides(config: Path, overrides: Sequence[str]) -> list[str]:
    """`overrides` with the keys of the file aggregation.identity_keys names, under secure
    aggregation, as `silos.<S>.identity_key=<base64>` overrides in its place: the file is on the
    submitter's machine, which the job's driver and silos cannot read."""
    from silo_pfl.config import merge_config, read_yaml
    from silo_pfl.secure.identity import read_key_file

    cfg = merge_config(read_yaml(config), list(overrides))
    if not (cfg.aggregation.secure and cfg.aggregation.identity_keys):
        return list(overrides)
    keys = read_key_file(Path(cfg.aggregation.identity_keys))
    kept = [o for o in overrides if not o.startswith("aggregation.identity_keys=")]
    listed = [f"silos.{silo}.identity_key={key}" for silo, key in keys.items()]
    return [*kept, "aggregation.identity_keys=null", *listed]


def _installed(path: Path) -> bool:
    """Whether `path` lies in an installed distribution, which a node has its own of."""
    return bool({"site-packages", "dist-packages"} & set(path.parts))


def plugin_code(plugins: Sequence[str]) -> list[str]:
    """The local code of each plugin (config `plugins`) to ship with a job: the directory of its
    top-level package (a namespace package's one directory), or its .py file, as this process
    imports it (the config's check imported them). Installed distributions (site-packages) are
    not shipped: a node has its own, as it has torch."""
    shipped: list[str] = []
    for module in plugins:
        top = module.split(".")[0]
        spec = None if top == "silo_pfl" else importlib.util.find_spec(top)
        if spec is None or spec.origin in ("built-in", "frozen"):
            continue
        locations = [Path(p) for p in spec.submodule_search_locations or []]
        if spec.origin is None:  # a namespace package (no __init__.py): its directories
            local = [str(p) for p in locations if not _installed(p)]
            if len(locations) > 1 and local:
                raise ConfigError(
                    f"plugins: {module}: namespace package {top} spans {len(locations)} "
                    f"directories ({', '.join(local)} among them), which a job cannot ship as "
                    f"one; give {top} an __init__.py in one directory"
                )
            if len(locations) != 1:
                continue
        path = locations[0] if locations else Path(str(spec.origin))
        if not _installed(path) and str(path) not in shipped:
            shipped.append(str(path))
    return shipped


def output_dir_note(output_dir: str, resume: bool | str) -> str | None:
    """A submitted run's directory must be found again for a later job to resume it. A relative
    output_dir is resolved by each process against its own working directory: on a node, the
    one its `ray start` ran in (`silo-pfl submit` gives the job no working_dir), which differs
    between nodes and installations. Refused for a resume; for a fresh run, what to print as a
    warning."""
    if Path(output_dir).expanduser().is_absolute():
        return None
    where = (
        f"output_dir: got {output_dir!r}, a relative path, which each node resolves against the "
        "directory its Ray was started in"
    )
    advice = "give an absolute path that every node can write, e.g. output_dir=/var/tmp/silo_pfl"
    if resume:
        raise ConfigError(f"{where}, so a resume cannot count on finding the run; {advice}")
    return f"{where}; to know where the run lies and resume it later, {advice}"


@dataclass(frozen=True)
class JobRow:
    """One line of `silo-pfl jobs`."""

    job_id: str
    status: str
    federation: str
    start_time: float | None  # seconds since the epoch

    def cells(self) -> tuple[str, str, str, str]:
        started = (
            time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.start_time))
            if self.start_time
            else "-"
        )
        return self.job_id, self.status, self.federation, started


def jobs_table(rows: Sequence[JobRow]) -> str:
    """`silo-pfl jobs`: a header and a row per job, in columns as wide as their widest cell."""
    cells = [("job id", "status", "federation", "started"), *(row.cells() for row in rows)]
    widths = [max(len(line[i]) for line in cells) + 2 for i in range(3)]
    return "\n".join(
        "".join(cell.ljust(width) for cell, width in zip(line, widths, strict=False)) + line[3]
        for line in cells
    )


def job_reason(message: str) -> str:
    """Ray's reason for a job's end in one line: the driver's own last `error:` line where its
    logs, which Ray quotes after its first line, hold one, then Ray's first line (the exit
    code), without the quote's announcement; a driver killed by a signal is named as such."""
    lines = message.strip().splitlines()
    if not lines:
        return ""
    first = lines[0].split(", last available logs")[0].rstrip(":, ")
    code = re.search(r"exit code (-?\d+)", first)
    killed = 0 if code is None else -int(code[1]) if int(code[1]) < 0 else int(code[1]) - 128
    if killed > 0:  # 128 + N from a shell (dash), -N where the shell exec'd the driver (bash)
        first += f" (the driver was killed by signal {killed})"
    said = [line.strip() for line in lines[1:] if line.strip().startswith("error: ")]
    return f"{said[-1].removeprefix('error: ')} ({first})" if said else first


class JobsClient:
    """A thin, checked wrapper of Ray's JobSubmissionClient with one-line errors."""

    def __init__(self, address: str | None, token_file: str | None = None) -> None:
        self.address, self.key = jobs_address(address), address_key(address)
        self.given = address or os.environ.get(self.key, self.address)  # as the user wrote it
        token = auth_token(token_file)
        self.token_source = token_source(token_file)[0] if token else "no token"
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._client: Any = None

    @property
    def client(self) -> Any:
        if self._client is None:
            from ray.job_submission import JobSubmissionClient

            for name in QUIET_LOGGERS:  # "Uploading package ...", "WebSocket closed ..."
                logging.getLogger(name).setLevel(logging.WARNING)

            with self._errors(), _without(ADDRESS_VARS):
                self._client = JobSubmissionClient(self.address, headers=self.headers)
        return self._client

    @contextmanager
    def _errors(self) -> Iterator[None]:
        """Turn the SDK's multi-line errors into one FederationError naming the address."""
        from ray.exceptions import AuthenticationError, RpcError

        try:
            yield
        except AuthenticationError as exc:
            raise FederationError(
                f"{self.key} {self.given}: the cluster refused the request, sent with "
                f"{self.token_source} ({one_line(exc)}); give the cluster's token with "
                f"--token-file or {TOKEN_VAR}"
            ) from None
        except (ConnectionError, RuntimeError, ValueError, RpcError) as exc:
            said = one_line(exc)
            if "Version check returned 404" in said:  # Ray's "ensure Ray 1.9 or higher"
                said = (
                    "it is not a Ray dashboard's Jobs API (no /api/version there); give the "
                    "dashboard's address, e.g. http://HOST:8265"
                )
            raise FederationError(f"{self.key} {self.given}: {said}") from None

    def submit(
        self,
        config: Path,
        overrides: Sequence[str],
        federation: str,
        quiet: bool = False,
        resume: bool | str = False,
        plugins: Sequence[str] = (),
        onboard: Sequence[str] = (),
    ) -> str:
        """Submit `python -m silo_pfl run` on the config (with `--resume [RUN_ID]` if `resume`),
        or, given `onboard` (`silo-pfl onboard`'s options: --silo SILO ...), `python -m silo_pfl
        onboard`, shipping silo_pfl and the `plugins` modules' code, and the keys of
        aggregation.identity_keys's file in its place (`identity_key_overrides`); return the job's
        id."""
        import silo_pfl

        inline = INLINE_CONFIG + base64.b64encode(config.read_bytes()).decode()
        verb = "onboard" if onboard else "run"
        overrides = identity_key_overrides(config, overrides)
        command = ["python", "-m", "silo_pfl", verb, inline, *overrides, "--results-in-log"]
        command += list(onboard)
        command += ["--quiet"] if quiet else []
        if resume is not False:  # an empty RUN_ID too: the driver refuses it
            command += ["--resume"] if resume is True else ["--resume", resume]
        job_id = f"silo-pfl-{federation}-{secrets.token_hex(4)}"
        runtime_env = {
            "py_modules": [str(Path(silo_pfl.__file__).parent), *plugin_code(plugins)],
            "excludes": ["__pycache__"],
        }
        with self._errors():
            return str(
                self.client.submit_job(
                    entrypoint=shlex.join(command),
                    submission_id=job_id,
                    runtime_env=runtime_env,
                    metadata={METADATA_KEY: federation},
                )
            )

    def follow(self, job_id: str, stream: TextIO) -> str:
        """Print the job's logs as they come; return its final status."""

        async def tail() -> None:
            async for chunk in self.client.tail_job_logs(job_id):
                lines = chunk.splitlines(keepends=True)
                stream.write("".join(x for x in lines if not x.startswith(RESULTS_MARKER)))
                stream.flush()

        with self._errors():
            asyncio.run(tail())
        return self.wait(job_id)

    def wait(self, job_id: str) -> str:
        """Poll until the job is in a terminal state; return it."""
        while True:
            with self._errors():
                status = str(self.client.get_job_status(job_id).value)
            if status in TERMINAL:
                return status
            time.sleep(POLL_SECONDS)

    def results(self, job_id: str) -> dict[str, Any]:
        """The results JSON the job's run printed in its logs (`--results-in-log`)."""
        with self._errors():
            logs = self.client.get_job_logs(job_id)
        for line in reversed(logs.splitlines()):
            if line.startswith(RESULTS_MARKER):
                return dict(json.loads(line[len(RESULTS_MARKER) :]))
        raise FederationError(f"job {job_id}: its logs hold no results line")

    def message(self, job_id: str) -> str:
        """Ray's one-line reason for the job's state (e.g. why it failed), or ''."""
        with self._errors():
            info = self.client.get_job_info(job_id)
        return job_reason(info.message or "")

    def list(self, limit: int = 20) -> list[JobRow]:
        """The most recent submitted jobs first (drivers that joined directly are not jobs)."""
        with self._errors():
            jobs = [job for job in self.client.list_jobs() if job.submission_id]
        rows = [
            JobRow(
                job_id=str(job.submission_id or job.job_id),
                status=str(job.status.value),
                federation=str((job.metadata or {}).get(METADATA_KEY, "-")),
                start_time=job.start_time / 1000 if job.start_time else None,
            )
            for job in jobs
        ]
        rows.sort(key=lambda r: r.start_time or 0, reverse=True)
        return rows[:limit]

    def stop(self, job_id: str) -> bool:
        """Ask the cluster to stop the job; False if it had already ended."""
        with self._errors():
            return bool(self.client.stop_job(job_id))


def print_results_line(data: dict[str, Any], stream: TextIO = sys.stdout) -> None:
    """The one line `JobsClient.results` looks for in a job's logs."""
    from silo_pfl.results import json_default

    stream.write(RESULTS_MARKER + json.dumps(data, default=json_default) + "\n")
    stream.flush()
