"""Hooks into a run: progress, MLflow and metrics subclass Callback; every hook is a no-op."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, TextIO

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

    def on_round_start(self, round_: int) -> None:
        """Before a round's first attempt."""

    def on_round_end(self, summary: RoundSummary) -> None:
        """After a round's aggregation, evaluation and checkpoint."""

    def on_exported(self, receipts: Mapping[str, dict[str, str]]) -> None:
        """After the last round: each silo's receipt from the exporter this callback gave it."""

    def extras(self) -> dict[str, Any]:
        """Entries this callback adds to FederationResult.extras, before on_end."""
        return {}

    def on_end(self, result: FederationResult) -> None:
        """After the last round, with the final result."""

    def state(self) -> dict[str, Any]:
        """What this callback needs to go on after a resume (checkpointed with every round)."""
        return {}

    def restore(self, state: dict[str, Any]) -> None:
        """On resume, before on_start: what `state` returned at the checkpoint resumed from."""

    def on_resumed(self, history: Sequence[RoundSummary]) -> None:
        """On resume, after on_start: the rounds already done. A round may have been
        checkpointed before the interrupted run's callbacks saw its end."""


class ProgressPrinter(Callback):
    """Prints the split, a line per round, and a per-silo table at the end."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stdout
        self.rounds = 0

    def _print(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def on_start(
        self, config: FederationConfig, silos: Sequence[SiloInfo], split: SplitInfo
    ) -> None:
        self.rounds = config.rounds
        self._print(
            f"federation {config.name}: {len(silos)} silos, algorithm {config.algorithm['name']}, "
            f"model {config.model.name}, {config.rounds} rounds, seed {config.seed}"
        )
        self._print(
            f"split: {split.global_parameters} global / {split.local_parameters} local parameters;"
            f" {split.bytes_sent_per_round} bytes sent per silo per round"
        )

    def on_round_end(self, summary: RoundSummary) -> None:
        width = len(str(self.rounds))
        self._print(
            f"round {summary.round:>{width}}/{self.rounds}  {summary.seconds:6.2f}s  "
            f"loss {summary.mean_train_loss:.4f}  val {summary.mean_val_accuracy:.3f}  "
            f"mean test acc {summary.mean_test_accuracy:.3f}"
            + (f"  (attempt {summary.attempts})" if summary.attempts > 1 else "")
        )
        for silo, how in summary.restarted.items():
            self._print(f"  {silo}: restarted, restored round {how['round']}")
        for silo, reason in summary.absent.items():
            self._print(f"  {silo}: left out: {reason}")

    def on_end(self, result: FederationResult) -> None:
        header = f"{'silo':<14}{'train':>7}{'val':>6}{'test':>6}{'round':>7}{'val acc':>9}"
        header += f"{'test acc':>10}{'bytes/round':>13}"
        self._print("")
        self._print(header)
        for name, silo in result.silos.items():
            self._print(
                f"{name:<14}{silo.num_train:>7}{silo.num_val:>6}{silo.num_test:>6}"
                f"{silo.selected_round:>7}{silo.val_accuracy:>9.3f}{silo.test_accuracy:>10.3f}"
                f"{silo.bytes_sent_per_round:>13}"
            )
        self._print(
            f"mean test accuracy {result.mean_test_accuracy:.4f}  worst "
            f"{result.worst_test_accuracy:.4f}  std {result.std_test_accuracy:.4f}  "
            f"({result.wall_seconds:.1f}s)"
        )
