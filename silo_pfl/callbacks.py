"""Hooks into a run: progress, MLflow and metrics subclass Callback; every hook is a no-op."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from silo_pfl.config import FederationConfig
from silo_pfl.messages import SiloInfo, SplitInfo
from silo_pfl.results import FederationResult, RoundSummary

if TYPE_CHECKING:
    from silo_pfl.silo import SiloExporter


class Callback:
    """Called by the orchestrator on the driver; every hook does nothing by default."""

    def on_start(
        self, config: FederationConfig, silos: Sequence[SiloInfo], split: SplitInfo
    ) -> None:
        """After every silo is set up, before round 1."""

    def exporters(self, silos: Sequence[SiloInfo]) -> Mapping[str, SiloExporter]:
        """After on_start: per silo, an exporter that silo checks now and runs at the end.

        The silo runs it on its selected personalized model in its own process, so the model's
        local keys go only to the store that exporter targets, never through the driver.
        """
        return {}

    def early_exporters(self, silos: Sequence[SiloInfo]) -> Mapping[str, SiloExporter]:
        """Before on_start: of the exporters `exporters` gives, those that need nothing on_start
        makes (a silo's own store), for their silos to check before the run is recorded as
        started; `exporters` gives them again after on_start."""
        return {}

    def on_round_start(self, round_: int) -> None:
        """Before the driver waits for a round's first attempt (its silos may be fitting
        already: in the clear, a round's fits are sent with the commits of the round before)."""

    def on_round_end(self, summary: RoundSummary) -> None:
        """After a round's aggregation, evaluation and checkpoint."""

    def on_exported(self, receipts: Mapping[str, dict[str, str]]) -> None:
        """After the last round: each silo's receipt from the exporter this callback gave it."""

    def extras(self) -> dict[str, Any]:
        """Entries this callback adds to FederationResult.extras, before on_end."""
        return {}

    def on_end(self, result: FederationResult) -> None:
        """After the last round, with the final result."""

    def on_closed(self) -> None:
        """Last, once the run has left Ray: what on_end started in the background ends here."""

    def state(self) -> dict[str, Any]:
        """What this callback needs to go on after a resume (checkpointed with every round)."""
        return {}

    def restore(self, state: dict[str, Any]) -> None:
        """On resume, before on_start: what `state` returned at the checkpoint resumed from."""

    def on_resumed(self, history: Sequence[RoundSummary]) -> None:
        """On resume, after on_start: the rounds already done. A round may have been
        checkpointed before the interrupted run's callbacks saw its end."""
