"""eval.every=k: the personalized models are evaluated every k rounds and at the last; only those
rounds can be selected; the rounds between are committed for resume, without a model, and
training is the same as with an evaluation every round."""

from __future__ import annotations

import math

import numpy as np
import pytest

from silo_pfl import checkpoint
from silo_pfl.config import to_dict
from silo_pfl.errors import FederationError
from silo_pfl.federation import Federation
from silo_pfl.selection import evaluated
from silo_pfl.server_start import new_server
from silo_pfl.silo import Silo
from silo_pfl.silo_store import CHECKPOINTS

HEART = ("jobs/heart_disease.yaml", "tracking.enabled=false", "algorithm.name=fedper")


def test_every_kth_round_and_the_last_are_evaluated():
    assert [r for r in range(1, 8) if evaluated(r, 7, 3)] == [3, 6, 7]
    assert [r for r in range(1, 5) if evaluated(r, 4, 1)] == [1, 2, 3, 4]
    assert [r for r in range(1, 4) if evaluated(r, 3, 10)] == [3]


def test_a_round_committed_unevaluated_holds_no_model_and_cannot_be_selected(job, tmp_path):
    config = to_dict(job(*HEART, "round.min_silos=1", f"output_dir={tmp_path}"))
    silo = Silo(config, "cleveland")
    info = silo.setup()
    silo.build(info.input_shape, info.num_classes)
    server = new_server(config, info.input_shape, info.num_classes)
    for round_ in (1, 2):
        update, _ = silo.fit(server.global_state(), round_, 1, server.broadcast())
        assert server.aggregate(update).aggregated
        if round_ == 1:
            silo.evaluate_and_commit(server.global_state(), round_, None)
        else:
            silo.commit_unevaluated(round_, 1)
    folder = silo.dir / CHECKPOINTS
    assert "model" in checkpoint.load(folder, 1)
    assert "model" not in checkpoint.load(folder, 2)
    assert silo.committed == 2 and silo.outcome().selected_round == 1
    with pytest.raises(FederationError, match="no model of round 2 to select"):
        silo.select(2)


@pytest.mark.usefixtures("ray_local")
def test_a_run_evaluated_every_third_round_trains_as_one_evaluated_every_round(job):
    """Rounds 3, 6 and 7 are evaluated, score as in the run that evaluates every round, and are
    the only ones selection may choose; the final global state is the same bit for bit."""
    overrides = (*HEART, "rounds=7", "eval.selection=best_val")
    every = Federation(job(*overrides)).run()
    third = Federation(job(*overrides, "eval.every=3")).run()

    assert [s.evaluated for s in third.history] == [r in (3, 6, 7) for r in range(1, 8)]
    for summary, alike in zip(third.history, every.history, strict=True):
        assert summary.participants == alike.participants
        for silo, figures in summary.silos.items():
            assert figures["train_loss"] == alike.silos[silo]["train_loss"]
            if summary.evaluated:
                assert figures["val_accuracy"] == alike.silos[silo]["val_accuracy"]
                assert figures["test_accuracy"] == alike.silos[silo]["test_accuracy"]
            else:
                assert "val_accuracy" not in figures and "test_accuracy" not in figures
        if not summary.evaluated:
            assert math.isnan(summary.mean_val_accuracy)
    for silo, outcome in third.silos.items():
        val = {r: every.history[r - 1].silos[silo]["val_accuracy"] for r in (3, 6, 7)}
        assert outcome.selected_round in val
        assert outcome.val_accuracy == max(val.values())
    selected_in_between = {
        s: o.selected_round for s, o in every.silos.items() if o.selected_round not in (3, 6, 7)
    }
    assert selected_in_between, "every best round is evaluated anyway: the test shows nothing"

    a, b = np.load(every.global_state_path), np.load(third.global_state_path)
    assert a.files == b.files and all(np.array_equal(a[k], b[k]) for k in a.files)


@pytest.mark.usefixtures("ray_local")
def test_a_run_resumed_with_more_rounds_evaluates_its_old_last_round_and_the_new_ones(job):
    """The old last round was evaluated as the last; the rounds after it follow the rule with
    the new last round, and selection chooses among all the evaluated ones."""
    overrides = (*HEART, "eval.every=3", "eval.selection=best_val")
    first = Federation(job(*overrides, "rounds=4")).run()
    assert [s.evaluated for s in first.history] == [False, False, True, True]
    longer = Federation(job(*overrides, "rounds=7")).run(resume=True)
    assert [s.round for s in longer.history] == list(range(1, 8))
    assert [s.evaluated for s in longer.history] == [r in (3, 4, 6, 7) for r in range(1, 8)]
    for silo, outcome in longer.silos.items():
        val = {s.round: s.silos[silo]["val_accuracy"] for s in longer.history if s.evaluated}
        assert outcome.selected_round in val and outcome.val_accuracy == max(val.values())
