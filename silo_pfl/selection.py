"""Model selection on validation data, never on test data.

Modes (eval.selection):
  best_mean_val  one round for the whole federation: the best mean validation accuracy over silos
                 (ties: lower mean validation loss). For FedAvg this keeps one global model.
                 A round is compared with the models selected now, on the silos it evaluated:
                 a round that left a weak silo out does not win by its absence. A silo with no
                 model selected yet (left out of the rounds that won: rejected, late or dead)
                 takes its first evaluated one, and is compared on from then on.
  best_val       each silo its own round: its best validation accuracy (ties: lower loss).
  last           the last round.
A silo with no validation rows is not compared: under best_val and last it takes its last
evaluated round; under best_mean_val, the round the other silos' scores choose. A loss that is not
a number (NaN) ranks below every other at equal accuracy. A model with a value that is not finite
(fine-tuning that diverged at evaluation) is never selected: its silo keeps the model it had.

Only an evaluated round can be selected. With eval.every=k a round is evaluated when its number is
a multiple of k, and the last round always is (`evaluated`); the rounds between are committed for
resume, without a model to select.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np

from silo_pfl.messages import EvalMetrics

MODES = ("best_mean_val", "best_val", "last")
LEGACY_KEY = "*"  # best_mean_val's one entry in checkpoints before per-silo scores


def evaluated(round_: int, rounds: int, every: int) -> bool:
    """Whether round `round_` of a run of `rounds` is evaluated (eval.every=`every`)."""
    return round_ % every == 0 or round_ >= rounds


class Selector:
    """Decides after each round which silos keep their current model as their selected one."""

    def __init__(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown selection mode {mode!r}")
        self.mode = mode
        self.best: dict[str, tuple[float, float]] = {}

    def _improves(self, key: str, accuracy: float, loss: float) -> bool:
        if not np.isfinite(accuracy):
            return True
        score = _score(accuracy, loss)
        if key not in self.best or score > self.best[key]:
            self.best[key] = score
            return True
        return False

    def choose(self, evals: Sequence[EvalMetrics], unselected: Collection[str] = ()) -> list[str]:
        """The silos whose model of this round becomes (or stays) their selected one;
        `unselected` are the silos with no model selected yet."""
        evals = [e for e in evals if not e.diverged]
        if self.mode == "last":
            return [e.silo for e in evals]
        if self.mode == "best_val":
            return [e.silo for e in evals if self._improves(e.silo, e.val_accuracy, e.val_loss)]
        if self._round_improves(evals):
            return [e.silo for e in evals]
        first = [e for e in evals if e.silo in unselected]
        self.best.update(_scores(first))
        return [e.silo for e in first]

    def _round_improves(self, evals: Sequence[EvalMetrics]) -> bool:
        """best_mean_val: whether this round's mean beats the mean of the models selected now,
        over the silos with validation rows that both cover. `best` holds each silo's score of
        its selected model (a silo left out of a round keeps its earlier one)."""
        scored = _scores(evals)
        legacy = self.best.get(LEGACY_KEY)  # a checkpoint of an earlier version: a mean only
        common = list(scored) if legacy else [s for s in scored if s in self.best]
        if common:
            selected = legacy or _mean([self.best[s] for s in common])
            if not _mean([scored[s] for s in common]) > selected:
                return False
        self.best.pop(LEGACY_KEY, None)
        self.best.update(scored)
        return True


def never_finite(who: str, why: str, algorithm: str) -> str:
    """The one line for a silo (`who`) none of whose evaluated models could be selected, each
    not finite (`why`: the last one's key)."""
    return (
        f"{who}: its personalized model was not finite in every round it was evaluated ({why}), "
        f"so it has none to select; lower train.lr or the options of algorithm.{algorithm}"
    )


def _scores(evals: Sequence[EvalMetrics]) -> dict[str, tuple[float, float]]:
    """(accuracy, -loss) on validation of each silo of `evals` that has validation rows."""
    return {
        e.silo: _score(e.val_accuracy, e.val_loss) for e in evals if np.isfinite(e.val_accuracy)
    }


def _score(accuracy: float, loss: float) -> tuple[float, float]:
    """(accuracy, -loss), a NaN loss as the worst: NaN compares false both ways, so a score
    holding one would never be beaten at equal accuracy."""
    return accuracy, (-loss if not np.isnan(loss) else -np.inf)


def _mean(scores: list[tuple[float, float]]) -> tuple[float, float]:
    """The mean accuracy and the mean negated loss of (accuracy, -loss) pairs."""
    return float(np.mean([a for a, _ in scores])), float(np.mean([n for _, n in scores]))
