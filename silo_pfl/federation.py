"""The Python API: `Federation(config).run()`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from silo_pfl.callbacks import Callback
from silo_pfl.config import FederationConfig, read_yaml, written_keys
from silo_pfl.results import FederationResult
from silo_pfl.run_dir import check_resume
from silo_pfl.runtime.orchestrator import Orchestrator
from silo_pfl.settings import check_files_apart, is_checked, load_config, user_config


class Federation:
    """A federation of silos. `config` is a FederationConfig, a YAML path or a mapping."""

    def __init__(
        self,
        config: FederationConfig | str | Path | dict[str, Any],
        overrides: Sequence[str] | None = (),
        callbacks: Sequence[Callback] = (),
    ) -> None:
        overrides = () if overrides is None else overrides
        if isinstance(overrides, (str, bytes)):
            raise TypeError(f"overrides: got {overrides!r}, expected a list of 'key=value' strings")
        # The keys the user wrote (None: unknown, for a config loaded before), which onboarding
        # holds to the trained run's.
        self.written: set[str] | None = None
        if isinstance(config, (str, Path)):
            self.config = load_config(config, list(overrides))
            self.written = written_keys(read_yaml(Path(config)), list(overrides))
        elif isinstance(config, FederationConfig) and not overrides and is_checked(config):
            self.config = config  # as loaded, unchanged: checked, and its warnings said, once
        elif isinstance(config, (FederationConfig, Mapping)):
            self.config = user_config(config, list(overrides))  # built or changed by hand
            if not isinstance(config, FederationConfig):
                self.written = written_keys(config, list(overrides))
        else:
            raise TypeError(
                f"config: got {type(config).__name__}, expected a FederationConfig, a YAML "
                "path or a mapping"
            )
        self.callbacks = list(callbacks)

    def run(self, resume: bool | str = False) -> FederationResult:
        """Run every round and return the typed result.

        `resume=True` continues the latest run of this federation from its last checkpoint (a
        run id continues that run), in the same MLflow run; only `rounds` may differ, upwards.
        With tracking.enabled, an MlflowTracker joins the callbacks; it opens the store first,
        so a bad tracking.uri fails before any silo starts. MLflow is imported only then.
        """
        check_resume(resume)  # before the store is opened: a refused resume leaves nothing
        check_files_apart(self.config)
        if not self.config.tracking.enabled:
            return Orchestrator(self.config, self.callbacks, resume).run()
        from silo_pfl.tracking.tracker import MlflowTracker

        tracker = MlflowTracker(self.config)
        orchestrator = Orchestrator(self.config, [*self.callbacks, tracker], resume)
        try:
            return orchestrator.run()
        except BaseException as exc:
            tracker.abort(killed=isinstance(exc, KeyboardInterrupt))
            raise

    def onboard(
        self, silo: str, from_run: str | None = None, alone: bool = True
    ) -> FederationResult:
        """Cold start: silo `silo` joins this federation after it was trained.

        The trained run (`from_run`, else the federation's latest finished run in the tracking
        store) decides the model, split and algorithm, and gives the global layers, which stay
        frozen in the silo's own model (finetune and perfedavg adapt a copy when they evaluate,
        as for the founders); this config supplies the silo's data and its local fitting
        (`rounds` rounds of the algorithm's local procedure), and its seed and data split must be
        the trained run's. The silo's model is selected on its validation rows,
        evaluated on its test rows and registered as `<federation>-<silo>`, tagged
        joined=onboard. With `alone`, the same silo also trains alone, as the baseline; the
        result's `onboard` entry compares it with that and with the founders.
        """
        from silo_pfl.onboarding import alone_config, check_onboarding, joining_config
        from silo_pfl.runtime.onboarding import Onboarding
        from silo_pfl.tracking.registry import ONBOARD
        from silo_pfl.tracking.tracker import MlflowTracker
        from silo_pfl.tracking.trained_run import load_trained_run

        check_onboarding(self.config, silo)
        check_files_apart(self.config)
        trained = load_trained_run(str(self.config.tracking.uri), self.config.name, from_run)
        cfg = joining_config(trained, self.config, silo, self.written)
        tracker = MlflowTracker(cfg, ONBOARD, trained.run_id)
        baseline = alone_config(cfg) if alone else None
        onboarding = Onboarding(cfg, trained, silo, [*self.callbacks, tracker], baseline)
        try:
            return onboarding.run()
        except BaseException as exc:
            tracker.abort(killed=isinstance(exc, KeyboardInterrupt))
            raise
