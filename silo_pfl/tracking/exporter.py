"""MlflowExporter: run by a silo, in its own process, to put its personalized model in a store.

The driver builds one per silo (MlflowTracker.exporters) holding only where to write. The model
(global + local keys, read from the silo's directory, with the silo's Preprocessing) goes from
the silo's process straight into that one store, never through the driver:

- central store (tracking.uri): the tracker has created the silo's child run and a logged model
  for it; the silo writes the model's files into that logged model's artifact location, and the
  tracker then registers it (`registry.publish`). The silo needs no access to the registry.
- its own store (silos.<name>.tracking_uri): the silo does it all there, through the same
  `registry.publish`: a run, the logged model, its files, the registered version. The central
  store never sees the model. Its `$VARS` are filled in from the silo's node's environment, so
  the store's address and credentials need not be in the federation's config.

A silo imports MLflow in `check`, before round 1: a node that cannot import it fails before
training, and the import overlaps the server actor's start-up, which round 1 waits for anyway,
rather than contending with round 1's training for the silo's GIL and the machine's cores.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from silo_pfl.errors import ConfigError, FederationError, SiloPflError, typed_line
from silo_pfl.tracking import registry
from silo_pfl.tracking.store import (
    check_artifact_dir,
    check_store,
    ensure_experiment,
    open_client,
)
from silo_pfl.tracking.uri import node_uri, redact, sqlite_path

if TYPE_CHECKING:
    from mlflow import MlflowClient

    from silo_pfl.silo import PersonalizedModel

MODEL_NAME = "model"  # the logged model's name inside its run
CENTRAL_RUN = "central_run_id"  # a run's tag in a silo's own store: the federation's run


@dataclass(frozen=True)
class MlflowExporter:
    """Where one silo's model goes. Plain data: it is pickled to the silo's actor."""

    uri: str  # the store: tracking.uri, or the silo's own silos.<name>.tracking_uri ($VARS kept)
    key: str  # the config key naming that store, for errors
    experiment: str  # the federation's name
    parent_run_id: str  # the federation's run in the central store, for cross-reference
    # Central store only: the silo's child run, and the logged model created for its files.
    run_id: str | None = None
    model_id: str | None = None
    artifact_location: str | None = None
    joined: str = registry.FOUNDER  # how the silo joined the federation (a version tag)

    @property
    def own_store(self) -> bool:
        """True when the silo logs and registers its model in a store of its own."""
        return self.model_id is None

    def check(self, silo: str) -> None:
        """Before round 1, from the silo's node: its store (or artifact location) is usable,
        and, in its own store, its registered name is no other silo's."""
        with self._store_errors(silo, "checking its store"):
            self._check(silo)

    def _check(self, silo: str) -> None:
        if self.own_store:
            uri = node_uri(self.uri, self.key, silo)
            client = open_client(uri, self.key)
            ensure_experiment(client, uri, self.experiment, self.key)
            registry.check_owner(client, self.experiment, [silo], f"{self.key} {redact(uri)}")
        else:
            path = sqlite_path(self.uri)
            if path is not None and not path.is_file():
                raise ConfigError(
                    f"{self.key}: silo {silo} finds no SQLite store at {path} on its node; on "
                    "a cluster of several machines, point tracking.uri at a tracking server"
                )
            check_store(self.uri, self.key)  # a tracking server answers from this node too
            check_artifact_dir(str(self.artifact_location), self.key)
        import silo_pfl.tracking.pyfunc  # noqa: F401  (MLflow, pandas: see the module docstring)

    def export(self, model: PersonalizedModel) -> dict[str, str]:
        """Write the model (signature, input example) to the store; register it if own store."""
        with self._store_errors(model.silo, "exporting its model"):
            return self._export(model)

    @contextlib.contextmanager
    def _store_errors(self, silo: str, doing: str) -> Iterator[None]:
        """A store's failure, as one line with its credentials scrubbed (`typed_line`), before
        it leaves the silo's process: MLflow's own message holds the URL it called, password
        and all, and a silo's own store's are filled in on its node only."""
        try:
            yield
        except SiloPflError:
            raise
        except Exception as exc:
            raise FederationError(
                f"silo {silo}: {self.key} {redact(self.uri)}: {doing} failed ({typed_line(exc)})"
            ) from None

    def _export(self, model: PersonalizedModel) -> dict[str, str]:
        outcome = model.outcome
        scores = {
            registry.ROUND: str(outcome.selected_round),
            registry.VAL_ACCURACY: repr(outcome.val_accuracy),
            registry.TEST_ACCURACY: repr(outcome.test_accuracy),
            registry.VAL_ROWS: model.val_rows,
        }
        if not self.own_store:
            write_model(
                model, str(self.model_id), str(self.run_id), str(self.artifact_location), self.uri
            )
            return {"model_id": str(self.model_id), **scores}
        uri = node_uri(self.uri, self.key, model.silo)
        client = open_client(uri, self.key)
        experiment_id = ensure_experiment(client, uri, self.experiment, self.key)
        name = registry.model_name(self.experiment, model.silo)
        done = self._registered(client, experiment_id, name, model)
        if done is not None:
            receipt, run_id = registry.reuse(client, name, done), done.run_id
        else:
            receipt, run_id = self._register(client, experiment_id, name, model, uri)
        client.set_terminated(run_id)  # a resumed export's first attempt may have stopped before
        # As configured: with $VARS, what the node filled in stays on the node.
        return {**receipt, **scores, "tracking_uri": redact(self.uri), "run_id": run_id}

    def _register(
        self,
        client: MlflowClient,
        experiment_id: str,
        name: str,
        model: PersonalizedModel,
        uri: str,
    ) -> tuple[dict[str, str], str]:
        """A new own run, its logged model written and registered: the receipt, and the run."""
        outcome = model.outcome
        run_id = self._own_run(client, experiment_id, model)
        algorithm = model.config.algorithm["name"]
        logged = client.create_logged_model(
            experiment_id,
            name=MODEL_NAME,
            source_run_id=run_id,
            tags={registry.SILO: model.silo, registry.ALGORITHM: algorithm},
        )
        write_model(model, logged.model_id, run_id, logged.artifact_location, uri)
        tags = registry.version_tags(
            model.config.name,
            model.silo,
            algorithm,
            run_id,
            outcome.selected_round,
            outcome.val_accuracy,
            outcome.test_accuracy,
            model.val_rows,
            self.joined,
        )
        receipt = registry.publish(client, name, logged.model_id, logged.artifact_location, tags)
        return receipt, run_id

    def _registered(
        self, client: MlflowClient, experiment_id: str, name: str, model: PersonalizedModel
    ) -> Any | None:
        """The version of `name` that this federation run registered in the silo's own store
        for the selected round, if any: a resumed run exports again. Each export makes a new
        own run, so the version is found through its run's CENTRAL_RUN tag."""
        mine = f"tags.{CENTRAL_RUN} = '{self.parent_run_id}' and tags.{registry.SILO} = "
        runs = client.search_runs([experiment_id], f"{mine}'{model.silo}'")
        mine = {run.info.run_id for run in runs}
        return (
            registry.registered(client, name, mine, model.outcome.selected_round) if mine else None
        )

    def _own_run(self, client: MlflowClient, experiment_id: str, model: PersonalizedModel) -> str:
        """A run in the silo's own store, with the selected model's scores."""
        from mlflow.entities import Metric

        outcome = model.outcome
        run = client.create_run(
            experiment_id,
            run_name=model.silo,
            tags={
                registry.SILO: model.silo,
                registry.ALGORITHM: model.config.algorithm["name"],
                CENTRAL_RUN: self.parent_run_id,
            },
        )
        values = {
            "selected_round": float(outcome.selected_round),
            "selected_val_accuracy": outcome.val_accuracy,
            "selected_test_accuracy": outcome.test_accuracy,
        }
        client.log_batch(run.info.run_id, [Metric(k, v, 0, 0) for k, v in values.items()])
        return run.info.run_id


def _requirements() -> list[str]:
    import cloudpickle
    import numpy
    import omegaconf
    import pandas
    import torch

    modules: list[Any] = [torch, numpy, pandas, cloudpickle, omegaconf]
    return [f"{m.__name__}=={m.__version__.split('+')[0]}" for m in modules]


@contextlib.contextmanager
def _known_packages(requirements: list[str]) -> Iterator[None]:
    """For one save: tell MLflow which installed packages our pinned requirements are.

    To warn about requirement mismatches, MLflow maps every installed package to its modules
    first (a scan of each package's file list: 1.3 to 13 CPU-seconds per process on these
    machines). Our requirements are pinned from this very environment, so the scan is wasted.
    MLflow caches that map in a private module global: while it is unset we give it our few
    packages, and unset it again after, so nothing else in the process sees a partial map. If
    MLflow's internals change, this does nothing and MLflow scans as usual.
    """
    from mlflow.utils import requirements_utils as cache

    if getattr(cache, "_MODULES_TO_PACKAGES", "absent") is not None:
        yield
        return
    names = [r.split("==")[0] for r in requirements] + ["mlflow"]
    cache._MODULES_TO_PACKAGES = {name: [name] for name in names}
    try:
        yield
    finally:
        cache._MODULES_TO_PACKAGES = None
        cache._PACKAGES_TO_MODULES = None


def save_pyfunc(model: PersonalizedModel, path: Path, mlflow_model: Any = None) -> None:
    """Save the silo's pyfunc model (signature, synthetic input example, pinned requirements)
    to the directory `path`.

    Requirements are given, not inferred, and the input example is not re-run: inferring and
    re-running would cost seconds per silo.
    """
    import mlflow.pyfunc
    import pandas as pd

    from silo_pfl.tracking.pyfunc import STATE_ARTIFACT, SiloPyfunc, signature

    cfg = model.config
    python_model = SiloPyfunc(
        source=cfg.data.source,
        model_name=cfg.model.name,
        hidden=list(cfg.model.hidden),
        input_shape=model.input_shape,
        num_classes=model.num_classes,
        raw_columns=model.raw_columns,
        preprocessing=model.preprocessing,
        adapter_dim=cfg.model.adapter_dim,
        algorithm=dataclasses.asdict(cfg)["algorithm"],
        plugins=list(cfg.plugins),
    )
    requirements = _requirements()
    outcome = model.outcome
    with _known_packages(requirements):
        mlflow.pyfunc.save_model(
            path,
            python_model=python_model,
            artifacts={STATE_ARTIFACT: str(model.state_path)},
            signature=signature(model.raw_columns),
            input_example=pd.DataFrame(model.example, columns=list(model.raw_columns)),
            pip_requirements=requirements,
            mlflow_model=mlflow_model,
            metadata={
                registry.FEDERATION: cfg.name,
                registry.SILO: model.silo,
                registry.ALGORITHM: cfg.algorithm["name"],
                registry.ROUND: outcome.selected_round,
                registry.VAL_ACCURACY: outcome.val_accuracy,
                registry.TEST_ACCURACY: outcome.test_accuracy,
                **({"plugins": list(cfg.plugins)} if cfg.plugins else {}),
            },
        )


def write_model(
    model: PersonalizedModel, model_id: str, run_id: str, location: str, uri: str
) -> None:
    """Save the silo's pyfunc model and upload its files to a logged model's artifact location."""
    from mlflow.models import Model
    from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / MODEL_NAME
        saved_as = Model(
            artifact_path=location, run_id=run_id, model_uuid=model_id, model_id=model_id
        )
        save_pyfunc(model, path, saved_as)
        get_artifact_repository(location, tracking_uri=uri).log_artifacts(str(path))


# A kept-local model's directory, in the silo's: <output_dir>/<name>/<run_id>/silos/<silo>/model
LOCAL_MODEL_DIR = "model"


@dataclass(frozen=True)
class LocalExporter:
    """Under privacy.central_models=global_only or none, for a silo without a store of its own:
    its model is saved as an MLflow model in its own directory, on its node, and goes nowhere
    else (`silo-pfl models --local DIR` lists such models; `mlflow models serve -m PATH` serves
    one)."""

    def check(self, silo: str) -> None:
        import silo_pfl.tracking.pyfunc  # noqa: F401  (MLflow, pandas: see the module docstring)

    def export(self, model: PersonalizedModel) -> dict[str, str]:
        directory = model.state_path.parent.parent / LOCAL_MODEL_DIR
        if directory.exists():
            shutil.rmtree(directory)
        save_pyfunc(model, directory)
        outcome = model.outcome
        return {
            "model_uri": str(
                directory.absolute()
            ),  # on the silo's node; output_dir may be relative
            registry.ROUND: str(outcome.selected_round),
            registry.VAL_ACCURACY: repr(outcome.val_accuracy),
            registry.TEST_ACCURACY: repr(outcome.test_accuracy),
        }
