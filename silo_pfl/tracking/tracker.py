"""MlflowTracker: the driver-side Callback that records a federation run in MLflow.

One experiment per federation name. Per run: a parent run (the resolved config as flattened
params, per-round means, the final summary; as artifacts the global model, the split summary,
the silos' label counts and the run report) and a nested child run per silo (its round metrics
with step=round; tags silo, node_id, algorithm). The driver logs numbers only: each silo writes
its own model's files from its own process (MlflowExporter), and the tracker then registers the
central silos' models.
"""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from silo_pfl.callbacks import Callback
from silo_pfl.config import FederationConfig, to_dict
from silo_pfl.config_views import logged_view
from silo_pfl.data import silo_names
from silo_pfl.errors import ConfigError, FederationError, one_line, typed_line
from silo_pfl.messages import SiloInfo, SplitInfo, model_shape
from silo_pfl.results import FederationResult, RoundSummary, json_text
from silo_pfl.settings import split_rules
from silo_pfl.stop_signals import signals_held
from silo_pfl.tracking import registry
from silo_pfl.tracking.exporter import MODEL_NAME, LocalExporter, MlflowExporter
from silo_pfl.tracking.store import (
    check_artifact_dir,
    check_experiment,
    check_store,
    ensure_experiment,
    open_client,
)
from silo_pfl.tracking.trained_run import FEDERATION_FILE, federation_record
from silo_pfl.tracking.uri import artifact_dir, redact
from silo_pfl.tracking.whole_calls import local_database, whole_steps

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities import Metric

PARENT_RUN_TAG = "mlflow.parentRunId"
TRAINED_RUN = "trained_run_id"  # an onboarding run's tag: the federation run it joined
# The parent run's tag: the rounds the run goes to, set at start and again on a resume, which
# may raise them (the `rounds` param, like every MLflow param, keeps its first value).
ROUNDS_TAG = "rounds"
MAX_PARAMS_PER_BATCH = 100
MAX_METRICS_PER_BATCH = 1000
# Round metrics reach the store at most this late, one batch per run. Batches are written
# synchronously: after any asynchronous logging, MLflow's set_terminated costs ~0.2 s per run.
FLUSH_SECONDS = 2.0
MAX_PARAM_LENGTH = 6000
ROUND_MEANS = ("mean_train_loss", "mean_val_accuracy", "mean_test_accuracy")
# A round's means go to the parent run as round_<name>: `mean_test_accuracy` there is the run's
# final figure (the selected models'), one value, not a last point on the rounds' curve.
ROUND_PREFIX = "round_"
PARTITION_FILE = "partition.json"
FINAL_METRICS = ("mean_test_accuracy", "worst_test_accuracy", "std_test_accuracy", "wall_seconds")


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested config (its config_views.logged_view) -> {"train.lr": "0.05", ...}; data.paths
    only as the names of the silos that have one."""
    flat: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if name == "data.paths" and isinstance(value, Mapping):
            flat[name] = ",".join(value)
        elif isinstance(value, Mapping) and value:
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = str(value)[:MAX_PARAM_LENGTH]
    return flat


def partition_counts(silos: Sequence[SiloInfo]) -> dict[str, list[int]] | None:
    """What `partition.json` holds under "silos": each silo's training rows per class, as the
    silos counted them; None when no silo reported counts (aggregation.secure)."""
    counts = {info.silo: list(info.label_counts) for info in silos if info.label_counts}
    return counts or None


def _now_ms() -> int:
    return int(time.time() * 1000)


def _open(
    opening: Future[tuple[MlflowClient, str | None]], uri: str, name: str, silos: list[str]
) -> None:
    """Open the store, check that the registered names of `silos` (those whose models it
    registers) are no other federation's or silo's, then check the experiment (its id, or None:
    it is made once the silos have set up, so a run refused before leaves none); the result or
    the error goes to `opening`."""
    try:
        client = open_client(uri, "tracking.uri")
        registry.check_owner(client, name, silos, f"tracking.uri {redact(uri)}")
        opening.set_result((client, check_experiment(client, uri, name, "tracking.uri")))
    except BaseException as exc:
        opening.set_exception(exc)


def _answered(exc: Exception) -> bool:
    """Whether the store answered the call that raised `exc`, with an error of its own (a
    run deleted, a logged model gone): an HTTP store's error response, or a local store's
    MLflow error with a code. A request that got no answer after MLflow's retries is an
    MlflowException with the generic INTERNAL_ERROR, as is any other failure; a database
    still locked after its busy timeout (SQLite's: 20 s) is TEMPORARILY_UNAVAILABLE."""
    from mlflow.exceptions import MlflowException, RestException

    if isinstance(exc, RestException):
        return True
    unanswered = ("INTERNAL_ERROR", "TEMPORARILY_UNAVAILABLE")
    return isinstance(exc, MlflowException) and exc.error_code not in unanswered


class MlflowTracker(Callback):
    """Records one federation run.

    The checks that need no MLflow run when it is made, before Ray starts. Opening the store
    (MLflow's import, a new SQLite store's tables: a few seconds) runs in a thread meanwhile,
    while Ray starts and the silos set up; on_start waits for it and raises its error, if any,
    before round 1.
    """

    def __init__(
        self, cfg: FederationConfig, joined: str = registry.FOUNDER, trained_run: str = ""
    ) -> None:
        self.cfg = cfg
        # Onboarding (joined=onboard): the run records one silo joining `trained_run`.
        self.joined, self.trained_run = joined, trained_run
        self.uri = str(cfg.tracking.uri)
        check_store(self.uri, "tracking.uri")
        default_artifacts = artifact_dir(self.uri, cfg.name)
        if default_artifacts is not None:
            check_artifact_dir(str(default_artifacts), "tracking.uri")
        self.own_stores = {s: c.tracking_uri for s, c in cfg.silos.items() if c.tracking_uri}
        self.central = cfg.privacy.central_models  # what of the models the central store gets
        # A federation's silos are known now; a joining silo's name only at on_start.
        founders = self._central(silo_names(cfg.data)) if joined == registry.FOUNDER else []
        self.opening: Future[tuple[MlflowClient, str | None]] = Future()
        args = (self.opening, self.uri, cfg.name, founders)
        threading.Thread(target=_open, args=args, name="mlflow-open", daemon=True).start()
        self.run_id = ""
        self.children: dict[str, str] = {}
        self.receipts: dict[str, dict[str, str]] = {}
        self.split: SplitInfo | None = None
        self.buffered: dict[str, list[Metric]] = {}
        self.flushed_at = time.monotonic()
        self.logged: dict[str, Any] = {}  # silo -> the logged model it writes its files into
        self.restarts: dict[str, int] = {}  # silo -> times it restarted, in the rounds seen
        self.partition: dict[str, list[int]] | None = None  # partition.json's, when logged
        self.reporting: threading.Thread | None = None  # the report, from on_end to on_closed
        self.unreachable = False  # the store stopped answering: the clean-up does not wait on it
        self.logged_steps: dict[str, set[int]] = {}  # on resume: run -> the rounds it holds
        self.held_keys: dict[str, set[str]] = {}  # on resume: run -> the metric keys it holds

    def _log(self, run_id: str, metrics: list[Metric]) -> None:
        """Buffer metrics; every FLUSH_SECONDS each run's buffer goes out as one batch."""
        self.buffered.setdefault(run_id, []).extend(metrics)
        if time.monotonic() - self.flushed_at >= FLUSH_SECONDS:
            self._flush()

    def _flush(self) -> None:
        """Write every run's buffered metrics, one batch per run. A store that stops answering
        stops the run, in one line naming it; the clean-up then leaves it alone (a store that
        answered with an error is still cleaned up)."""
        try:
            for run_id, metrics in self.buffered.items():
                for start in range(0, len(metrics), MAX_METRICS_PER_BATCH):
                    batch = metrics[start : start + MAX_METRICS_PER_BATCH]
                    self.client.log_batch(run_id, metrics=batch, synchronous=True)
        except Exception as exc:
            self.unreachable = not _answered(exc)
            raise FederationError(
                f"tracking.uri {redact(self.uri)}: the store stopped answering as the run logged "
                f"its figures ({one_line(exc)}); once it answers again, --resume goes on"
            ) from None
        self.buffered.clear()
        self.flushed_at = time.monotonic()

    def state(self) -> dict[str, Any]:
        """The MLflow runs this federation run logs to: a resume goes on in them. (The silos'
        restarts are not kept: on_resumed counts them again from the rounds it replays.)"""
        return {"run_id": self.run_id, "children": dict(self.children)}

    def restore(self, state: dict[str, Any]) -> None:
        self.run_id = str(state.get("run_id", ""))
        self.children = dict(state.get("children", {}))

    def _reopen(self) -> None:
        """On resume: the parent and child runs are RUNNING again; the resume is tagged. A run
        deleted meanwhile stops the resume in one line, with the command that restores it; the
        metric keys each run holds are kept, for on_end (`_unlogged`)."""
        from mlflow.entities import RunStatus

        runs = {
            run_id: self.client.get_run(run_id) for run_id in [self.run_id, *self.children.values()]
        }
        for run_id, run in runs.items():
            if run.info.lifecycle_stage == "deleted":
                raise ConfigError(
                    f"--resume: MLflow run {run_id} is deleted in tracking.uri "
                    f"{redact(self.uri)}; restore it first (mlflow runs restore --run-id {run_id})"
                )
        self.held_keys = {run_id: set(run.data.metrics) for run_id, run in runs.items()}
        running = RunStatus.to_string(RunStatus.RUNNING)
        for run_id in runs:
            self.client.update_run(run_id, status=running)
        self._fail_orphans()
        resumes = runs[self.run_id].data.tags.get("resumes", "0")
        self.client.set_tag(self.run_id, "resumes", str(int(resumes) + 1))
        self.client.set_tag(self.run_id, ROUNDS_TAG, str(self.cfg.rounds))

    def _fail_orphans(self) -> None:
        """On resume: the logged models an earlier attempt left PENDING (killed by SIGKILL or an
        OOM kill, so `abort` never marked them FAILED) are marked now; `exporters` makes new
        ones, and a PENDING model stays in the store's list forever."""
        search = partial(self.client.search_logged_models, [self.experiment_id])
        for child in self.children.values():
            pending = f"source_run_id = '{child}' AND status = 'PENDING'"
            for model in registry.pages(search, pending):
                self.client.finalize_logged_model(model.model_id, "FAILED")

    def on_start(
        self, config: FederationConfig, silos: Sequence[SiloInfo], split: SplitInfo
    ) -> None:
        from mlflow.entities import Param

        self.client, found = self.opening.result()
        self.experiment_id = found or ensure_experiment(
            self.client, self.uri, config.name, "tracking.uri"
        )
        if self.joined != registry.FOUNDER:  # a federation's silos were checked as it opened
            joining = self._central(info.silo for info in silos)
            registry.check_owner(
                self.client, config.name, joining, f"tracking.uri {redact(self.uri)}"
            )
        self.split = split
        self.partition = partition_counts(silos) if self.central == "full" else None
        if self.run_id:
            self._reopen()
            return
        algorithm = config.algorithm["name"]
        tags = {registry.ALGORITHM: algorithm, registry.FEDERATION: config.name}
        tags[ROUNDS_TAG] = str(config.rounds)
        if self.joined == registry.FOUNDER:
            run_name = f"{config.name}-{algorithm}-seed{config.seed}"
            tags[registry.RUN_KIND] = registry.FEDERATION_RUN
        else:
            run_name = f"{config.name}-{algorithm}-onboard-{'-'.join(i.silo for i in silos)}"
            tags.update({registry.RUN_KIND: registry.ONBOARD_RUN, TRAINED_RUN: self.trained_run})
        with whole_steps(self.uri):
            run = self.client.create_run(self.experiment_id, run_name=run_name, tags=tags)
            self.run_id = run.info.run_id
        resolved = logged_view(to_dict(config))
        params = [Param(k, v) for k, v in flatten(resolved).items()]
        for start in range(0, len(params), MAX_PARAMS_PER_BATCH):
            batch = params[start : start + MAX_PARAMS_PER_BATCH]
            self.client.log_batch(self.run_id, params=batch)
        if self.joined == registry.FOUNDER:
            record = federation_record(resolved, *model_shape(silos), silos[0].columns)
            self.client.log_text(self.run_id, record, FEDERATION_FILE)
        if self.partition is not None:
            record = json.dumps({"silos": self.partition}, indent=2)
            self.client.log_text(self.run_id, record, PARTITION_FILE)
        for info in silos:
            with whole_steps(self.uri):
                child = self.client.create_run(
                    self.experiment_id,
                    run_name=info.silo,
                    tags={
                        PARENT_RUN_TAG: self.run_id,
                        registry.SILO: info.silo,
                        "node_id": info.node_id,
                        registry.ALGORITHM: algorithm,
                        registry.JOINED: self.joined,
                        "model_store": self._model_store(info.silo),
                    },
                )
                self.children[info.silo] = child.info.run_id

    def _central(self, silos: Iterable[str]) -> list[str]:
        """Of `silos`, those whose models the central store registers."""
        return [silo for silo in silos if self._model_store(silo) == "central"]

    def _model_store(self, silo: str) -> str:
        """Where the silo's model goes: its own store, the central one, or its own directory."""
        if silo in self.own_stores:
            return "silo"
        return "central" if self.central == "full" else "local"

    def early_exporters(
        self, silos: Sequence[SiloInfo]
    ) -> dict[str, MlflowExporter | LocalExporter]:
        """The exporters of the silos with a store of their own: built from the config alone."""
        own = [info for info in silos if info.silo in self.own_stores]
        return self.exporters(own) if own else {}

    def exporters(self, silos: Sequence[SiloInfo]) -> dict[str, MlflowExporter | LocalExporter]:
        """Per silo: its own store; else, under privacy.central_models=full, a logged model in
        its child run to write into; else its own directory (LocalExporter)."""
        exporters: dict[str, MlflowExporter | LocalExporter] = {}
        name, algorithm = self.cfg.name, self.cfg.algorithm["name"]
        for info in silos:
            own = self.own_stores.get(info.silo)
            if own is not None:
                key = f"silos.{info.silo}.tracking_uri"
                exporter = MlflowExporter(own, key, name, self.run_id, joined=self.joined)
                exporters[info.silo] = exporter
                continue
            if self.cfg.privacy.central_models != "full":
                exporters[info.silo] = LocalExporter()
                continue
            child = self.children[info.silo]
            with whole_steps(self.uri):
                logged = self.client.create_logged_model(
                    self.experiment_id,
                    name=MODEL_NAME,
                    source_run_id=child,
                    tags={registry.SILO: info.silo, registry.ALGORITHM: algorithm},
                )
                self.logged[info.silo] = logged
            exporters[info.silo] = MlflowExporter(
                self.uri,
                "tracking.uri",
                name,
                self.run_id,
                child,
                logged.model_id,
                logged.artifact_location,
                self.joined,
            )
        return exporters

    def on_round_end(self, summary: RoundSummary) -> None:
        from mlflow.entities import Metric

        stamp, step = _now_ms(), summary.round
        for silo, child in self.children.items():
            values = {**summary.silos.get(silo, {}), "took_part": silo in summary.participants}
            metrics = [Metric(k, float(v), stamp, step) for k, v in values.items()]
            if step not in self.logged_steps.get(child, ()):
                self._log(child, metrics)
            if silo in summary.absent:
                self.client.set_tag(child, f"round_{step}_left_out", summary.absent[silo][:5000])
            if silo in summary.restarted:
                self.restarts[silo] = self.restarts.get(silo, 0) + 1
                self.client.set_tag(child, "restarts", str(self.restarts[silo]))
                digest = summary.restarted[silo]["local_digest"]
                self.client.set_tag(child, f"round_{step}_restored", digest)
        logged = ROUND_MEANS if summary.evaluated else ("mean_train_loss",)  # no accuracies
        means = [Metric(ROUND_PREFIX + k, float(getattr(summary, k)), stamp, step) for k in logged]
        if step not in self.logged_steps.get(self.run_id, ()):
            self._log(self.run_id, [*means, Metric("round_seconds", summary.seconds, stamp, step)])

    def on_resumed(self, history: Sequence[RoundSummary]) -> None:
        """Log the rounds the interrupted run checkpointed but never logged (it was killed
        between the two), so the resumed run's metrics have no gap; and remember, run by run,
        the rounds already logged (each run's batch goes in whole or not at all), which are not
        logged again, whether restored or done again, so they have no repeat either.

        The `restarts` tags are counted again from zero over `history`, every round the resumed
        run keeps: a count carried over from the checkpoint would count those rounds twice."""
        self._flush()
        self.restarts = {}
        keys = {self.run_id: "round_seconds", **dict.fromkeys(self.children.values(), "took_part")}
        self.logged_steps = {
            run: {m.step for m in self.client.get_metric_history(run, key)}
            for run, key in keys.items()
        }
        for summary in history:
            self.on_round_end(summary)

    def on_exported(self, receipts: Mapping[str, dict[str, str]]) -> None:
        """Register each central silo's model, now that its files are in place."""
        for silo, receipt in receipts.items():
            logged = self.logged.pop(silo, None)
            if logged is not None:
                tags = registry.version_tags(
                    self.cfg.name,
                    silo,
                    self.cfg.algorithm["name"],
                    self.children[silo],
                    int(receipt[registry.ROUND]),
                    float(receipt[registry.VAL_ACCURACY]),
                    float(receipt[registry.TEST_ACCURACY]),
                    receipt[registry.VAL_ROWS],
                    self.joined,
                )
                name = registry.model_name(self.cfg.name, silo)
                published = registry.publish(
                    self.client, name, logged.model_id, logged.artifact_location, tags
                )
                receipt = {**receipt, **published}
            self.receipts[silo] = receipt

    def extras(self) -> dict[str, Any]:
        """The results JSON's `mlflow` entry: where the run and each silo's model are."""
        entry: dict[str, Any] = {
            "tracking_uri": redact(self.uri),
            "experiment": self.cfg.name,
            "run_id": self.run_id,
            "models": {silo: r["model_uri"] for silo, r in self.receipts.items()},
        }
        if self.own_stores:
            entry["silo_tracking_uris"] = {s: redact(u) for s, u in self.own_stores.items()}
        return {"mlflow": entry}

    def _unlogged(self, run_id: str, metrics: list[Metric]) -> list[Metric]:
        """Of the final `metrics` of `run_id`, those the store does not hold yet at their step.
        A run stopped after on_end logged them but before its result.json was written resumes
        and ends again: its final figures are not logged twice. Only the keys the run held when
        it resumed are looked up."""
        held = self.held_keys.get(run_id, set())
        steps = {
            key: {m.step for m in self.client.get_metric_history(run_id, key)}
            for key in {m.key for m in metrics} & held
        }
        return [m for m in metrics if m.step not in steps.get(m.key, ())]

    def on_end(self, result: FederationResult) -> None:
        """The final figures at step=rounds: the parent's summary and each child's selected
        model (a resume that raises the rounds adds a point, at its own last round)."""
        from mlflow.entities import Metric, RunStatus

        stamp, step = _now_ms(), result.rounds
        final = [Metric(k, float(getattr(result, k)), stamp, step) for k in FINAL_METRICS]
        self.buffered.setdefault(self.run_id, []).extend(self._unlogged(self.run_id, final))
        for silo, outcome in result.silos.items():
            selected = {
                "selected_round": float(outcome.selected_round),
                "selected_val_accuracy": outcome.val_accuracy,
                "selected_test_accuracy": outcome.test_accuracy,
                **outcome.extras,
            }
            child = self.children[silo]
            metrics = [Metric(k, v, stamp, step) for k, v in selected.items()]
            self.buffered.setdefault(child, []).extend(self._unlogged(child, metrics))
        self._flush()
        self._log_artifacts(result)
        if self.cfg.tracking.report:
            self.reporting = threading.Thread(
                target=self._report, args=(result,), name="run-report", daemon=True
            )
            self.reporting.start()
        else:
            self._finish(RunStatus.to_string(RunStatus.FINISHED))

    def on_closed(self) -> None:
        """The report, drawn while Ray shut down, is logged: the run is FINISHED."""
        from mlflow.entities import RunStatus

        if self.reporting is not None:
            self.reporting.join()
            self.reporting = None
            self._finish(RunStatus.to_string(RunStatus.FINISHED))

    def _report(self, result: FederationResult) -> None:
        """The run report on the parent run (and in the run's directory, when it has one). A
        report that fails is one warning line: the run itself has finished."""
        from silo_pfl import report
        from silo_pfl.report.data import from_result

        try:
            run = from_result(
                result,
                self.run_id,
                self.cfg.aggregation.secure,
                self._split_summary(result),
                self.partition,
            )
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(result.run_dir) / "report" if result.run_dir else Path(tmp)
                report.write(run, out)
                report.publish(self.client, self.run_id, out)
        except Exception as exc:
            print(
                f"warning: run {self.run_id}: no run report: {typed_line(exc)}",
                file=sys.stderr,
                flush=True,
            )

    def _log_artifacts(self, result: FederationResult) -> None:
        """The global model (server's keys), the split summary and the result, on the parent."""
        if result.global_state_path and self.central != "none":
            self.client.log_artifact(self.run_id, result.global_state_path, "global_model")
        summary = self._split_summary(result)
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "split.json").write_text(json.dumps(summary, indent=2))
            (Path(tmp) / "result.json").write_text(json_text(result.to_dict()))
            self.client.log_artifacts(self.run_id, tmp)

    def _split_summary(self, result: FederationResult) -> dict[str, Any]:
        """The content of split.json: the split's rules and what it keeps home and sends."""
        split = self.split
        return {
            "rules": split_rules(self.cfg),
            "global_parameters": result.global_parameters,
            "local_parameters": result.local_parameters,
            "bytes_sent_per_round": split.bytes_sent_per_round if split else None,
            "model_bytes": split.model_bytes if split else None,
        }

    def _finish(self, status: str) -> None:
        for run_id in [*self.children.values(), self.run_id]:
            if run_id:
                self.client.set_terminated(run_id, status=status)

    def abort(self, killed: bool = False) -> None:
        """Mark the runs KILLED (interrupted) or FAILED (an error); never raises over either.

        A store that does not answer one call (MLflow gives up on it after its retries, about
        7 s) is left alone for the rest: the clean-up waits on it once, not once per silo. A
        store that answers with an error for one call (a logged model gone, say) still gets
        the others. Ctrl-C or SIGTERM meanwhile (a second one: the first began the clean-up)
        is held and dropped: cut short, the abort would leave runs RUNNING for good."""
        with signals_held():
            self._abort(killed)

    def _abort(self, killed: bool) -> None:
        if local_database(self.uri):
            # A new SQLite file's tables are made as the store opens (a few seconds, locally),
            # in a thread that the process's exit would kill half-way: a store that no later
            # run could open.
            with contextlib.suppress(BaseException):
                self.opening.exception()
        if self.reporting is not None:
            with contextlib.suppress(Exception):
                self.reporting.join()
            self.reporting = None
        if not self.run_id or self.unreachable:
            return
        from mlflow.entities import RunStatus

        with contextlib.suppress(Exception):
            self._flush()  # a store that does not answer: unreachable, left alone
        status = RunStatus.to_string(RunStatus.KILLED if killed else RunStatus.FAILED)
        calls: list[Callable[[], object]] = [
            partial(self.client.finalize_logged_model, logged.model_id, "FAILED")
            for logged in self.logged.values()
        ]
        for run_id in [*self.children.values(), self.run_id]:
            if run_id:
                calls.append(partial(self.client.set_terminated, run_id, status=status))
        for call in calls:
            if self.unreachable:
                return
            try:
                call()
            except Exception as exc:
                self.unreachable = not _answered(exc)
