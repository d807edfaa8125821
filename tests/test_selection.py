"""Model selection (selection.Selector): which round's model each silo keeps, from validation
metrics only. Plain class, no Ray; the config's check of eval.selection against the modes."""

from __future__ import annotations

import math

import pytest

from silo_pfl.errors import ConfigError
from silo_pfl.messages import EvalMetrics
from silo_pfl.selection import LEGACY_KEY, MODES, Selector
from silo_pfl.settings import load_config

JOB = "jobs/heart_disease.yaml"
NAN = math.nan


def ev(silo: str, round_: int, val_acc: float, val_loss: float, test_acc: float, test_loss=0.5):
    return EvalMetrics(silo, round_, val_acc, val_loss, test_acc, test_loss)


def kept_rounds(mode: str, rounds: list[list[EvalMetrics]]) -> dict[str, int]:
    """Drive a Selector as the round runner does (each round's evaluations in silo order, with
    the silos that have no model kept yet; the chosen silos keep that round's model); each
    silo's kept round at the end."""
    selector, kept = Selector(mode), {}
    everyone = {e.silo for evals in rounds for e in evals}
    for evals in rounds:
        chosen = selector.choose(evals, everyone - set(kept))
        assert set(chosen) <= {e.silo for e in evals}
        kept.update({e.silo: e.round for e in evals if e.silo in chosen})
    return kept


# Per silo, its validation accuracy peaks in one round and its test accuracy in another.
DISAGREEING = [
    [ev("a", 1, 0.60, 0.70, test_acc=0.95), ev("b", 1, 0.50, 0.80, test_acc=0.40)],
    [ev("a", 2, 0.80, 0.50, test_acc=0.55), ev("b", 2, 0.40, 0.90, test_acc=0.99)],
    [ev("a", 3, 0.70, 0.40, test_acc=0.99), ev("b", 3, 0.90, 0.30, test_acc=0.45)],
    [ev("a", 4, 0.65, 0.45, test_acc=0.97), ev("b", 4, 0.85, 0.35, test_acc=0.98)],
]


def test_best_val_keeps_each_silos_best_validation_round_not_its_best_test_round():
    assert kept_rounds("best_val", DISAGREEING) == {"a": 2, "b": 3}


def test_best_val_decides_round_by_round_which_silos_keep_their_model():
    selector = Selector("best_val")
    assert selector.choose(DISAGREEING[0]) == ["a", "b"]  # the first round is always kept
    assert selector.choose(DISAGREEING[1]) == ["a"]
    assert selector.choose(DISAGREEING[2]) == ["b"]
    assert selector.choose(DISAGREEING[3]) == []


def test_best_val_ties_go_to_the_lower_validation_loss_then_to_the_earlier_round():
    rounds = [
        [ev("lower_loss_later", 1, 0.75, 0.60, 0.5), ev("same_loss", 1, 0.75, 0.40, 0.5)],
        # Same accuracy: a lower loss wins even though its test accuracy is worse.
        [ev("lower_loss_later", 2, 0.75, 0.30, 0.1), ev("same_loss", 2, 0.75, 0.40, 0.9)],
        # Same accuracy, higher loss: not kept; same accuracy and loss: the earlier round stays.
        [ev("lower_loss_later", 3, 0.75, 0.35, 0.9), ev("same_loss", 3, 0.75, 0.40, 0.9)],
    ]
    assert kept_rounds("best_val", rounds) == {"lower_loss_later": 2, "same_loss": 1}


def test_a_lower_loss_never_beats_a_higher_accuracy():
    rounds = [[ev("a", 1, 0.80, 0.90, 0.5)], [ev("a", 2, 0.79, 0.01, 0.9)]]
    assert kept_rounds("best_val", rounds) == {"a": 1}
    assert kept_rounds("best_mean_val", rounds) == {"a": 1}


def test_last_keeps_every_silos_latest_round_whatever_its_metrics():
    selector = Selector("last")
    for evals in DISAGREEING:
        assert selector.choose(evals) == ["a", "b"]
    assert kept_rounds("last", DISAGREEING) == {"a": 4, "b": 4}


def test_best_mean_val_keeps_one_round_for_all_silos_on_mean_validation_accuracy():
    # Mean validation accuracy by round: 0.55, 0.60, 0.80, 0.75; mean test accuracy is best in
    # round 4 (0.975) and worst in round 3 (0.72).
    assert kept_rounds("best_mean_val", DISAGREEING) == {"a": 3, "b": 3}
    selector = Selector("best_mean_val")
    assert [selector.choose(evals) for evals in DISAGREEING] == [
        ["a", "b"],
        ["a", "b"],
        ["a", "b"],
        [],
    ]


def test_best_mean_val_ties_go_to_the_lower_mean_loss_then_to_the_earlier_round():
    # Values exact in binary, so that the means tie exactly.
    rounds = [
        [ev("a", 1, 0.875, 0.5, 0.5), ev("b", 1, 0.625, 0.5, 0.5)],  # mean 0.75, loss 0.5
        [ev("a", 2, 0.625, 0.25, 0.1), ev("b", 2, 0.875, 0.375, 0.1)],  # 0.75, 0.3125: kept
        [ev("a", 3, 0.75, 0.3125, 0.9), ev("b", 3, 0.75, 0.3125, 0.9)],  # 0.75, 0.3125: a tie
    ]
    assert kept_rounds("best_mean_val", rounds) == {"a": 2, "b": 2}


@pytest.mark.parametrize("mode", MODES)
def test_test_metrics_never_change_a_choice(mode):
    """The same validation figures with other test figures (even missing ones) give the same
    choices, round by round."""

    def with_test(evals: list[EvalMetrics], acc: float, loss: float) -> list[EvalMetrics]:
        return [ev(e.silo, e.round, e.val_accuracy, e.val_loss, acc, loss) for e in evals]

    variants = [
        DISAGREEING,
        [with_test(evals, 1.0 - 0.2 * i, 0.1 * i) for i, evals in enumerate(DISAGREEING)],
        [with_test(evals, NAN, NAN) for evals in DISAGREEING],
    ]
    choices = []
    for rounds in variants:
        selector = Selector(mode)
        choices.append([selector.choose(evals) for evals in rounds])
    assert choices[0] == choices[1] == choices[2]


def test_a_silo_without_validation_rows_falls_back_to_its_last_round():
    rounds = [
        [ev("a", r, acc, 0.5, 0.9), ev("no_val", r, NAN, NAN, 0.9)]
        for r, acc in ((1, 0.9), (2, 0.5), (3, 0.6))
    ]
    assert kept_rounds("best_val", rounds) == {"a": 1, "no_val": 3}
    # best_mean_val: the mean is over the silos with validation rows; with none, the last round.
    assert kept_rounds("best_mean_val", rounds) == {"a": 1, "no_val": 1}
    alone = [[e for e in evals if e.silo == "no_val"] for evals in rounds]
    assert kept_rounds("best_mean_val", alone) == {"no_val": 3}


def test_best_val_a_silo_left_out_of_a_round_keeps_its_earlier_choice():
    rounds = [
        [ev("a", 1, 0.6, 0.5, 0.5), ev("b", 1, 0.6, 0.5, 0.5)],
        [ev("b", 2, 0.7, 0.5, 0.5)],  # a did not evaluate round 2
        [ev("a", 3, 0.5, 0.5, 0.9), ev("b", 3, 0.5, 0.5, 0.9)],
    ]
    assert kept_rounds("best_val", rounds) == {"a": 1, "b": 2}


def test_best_mean_val_a_round_that_left_a_weak_silo_out_does_not_win_by_its_absence():
    rounds = [
        [ev("a", 1, 0.9, 0.5, 0.5), ev("b", 1, 0.9, 0.5, 0.5), ev("weak", 1, 0.3, 0.5, 0.5)],
        # Without "weak" the mean is 0.85, above round 1's 0.7; on a and b it is worse.
        [ev("a", 2, 0.85, 0.5, 0.9), ev("b", 2, 0.85, 0.5, 0.9)],
    ]
    assert kept_rounds("best_mean_val", rounds) == {"a": 1, "b": 1, "weak": 1}


def test_best_mean_val_compares_a_round_with_the_models_selected_now_on_its_silos():
    rounds = [
        [ev("a", 1, 0.9, 0.5, 0.5), ev("b", 1, 0.9, 0.5, 0.5), ev("weak", 1, 0.3, 0.5, 0.5)],
        [ev("a", 2, 0.95, 0.5, 0.5), ev("b", 2, 0.95, 0.5, 0.5)],  # better on a and b: kept
        # Mean 0.787 against the selected models' 0.733 (a and b of round 2, weak of round 1);
        # a comparison with round 2's mean over a and b alone (0.95) would refuse it.
        [ev("a", 3, 0.93, 0.5, 0.5), ev("b", 3, 0.93, 0.5, 0.5), ev("weak", 3, 0.5, 0.5, 0.5)],
    ]
    selector = Selector("best_mean_val")
    assert [selector.choose(evals) for evals in rounds] == [
        ["a", "b", "weak"],
        ["a", "b"],
        ["a", "b", "weak"],
    ]


def test_best_mean_val_a_silo_missing_from_the_first_round_gets_a_model_and_counts_after():
    """A silo left out of the round that won first (rejected, late or dead) takes its first
    evaluated model though that round loses; its score then counts in the comparisons."""
    rounds = [
        [ev("b", 1, 0.8, 0.5, 0.5)],
        [ev("a", 2, 0.95, 0.1, 0.5), ev("b", 2, 0.7, 0.6, 0.5), ev("no_val", 2, NAN, NAN, 0.5)],
        # Mean 0.89 over a and b against the selected models' 0.875 (a of round 2, b of round
        # 1); on b alone, 0.79 against 0.8, it would lose.
        [ev("a", 3, 0.99, 0.1, 0.5), ev("b", 3, 0.79, 0.6, 0.5)],
    ]
    assert kept_rounds("best_mean_val", rounds) == {"a": 3, "b": 3, "no_val": 2}


def test_best_mean_val_resumes_from_an_earlier_checkpoints_single_mean():
    """Checkpoints before per-silo scores hold the best round's mean under one key."""
    selector = Selector("best_mean_val")
    selector.best = {LEGACY_KEY: (0.7, -0.5)}
    assert selector.choose([ev("a", 5, 0.6, 0.5, 0.5), ev("b", 5, 0.7, 0.5, 0.5)]) == []
    assert selector.choose([ev("a", 6, 0.8, 0.5, 0.5), ev("b", 6, 0.7, 0.5, 0.5)]) == ["a", "b"]
    assert selector.best == {"a": (0.8, -0.5), "b": (0.7, -0.5)}


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="unknown selection mode 'best_test'"):
        Selector("best_test")


@pytest.mark.parametrize("mode", MODES)
def test_the_config_accepts_every_mode_the_selector_has(mode):
    assert load_config(JOB, [f"eval.selection={mode}"]).eval.selection == mode


def test_the_configs_error_for_a_bad_mode_lists_exactly_the_selectors_modes():
    with pytest.raises(ConfigError) as info:
        load_config(JOB, ["eval.selection=latest"])
    assert str(info.value) == f"eval.selection: got 'latest', expected one of {', '.join(MODES)}"


@pytest.mark.parametrize("mode", ["best_val", "best_mean_val"])
def test_a_nan_validation_loss_is_beaten_by_a_later_round_of_equal_accuracy(mode):
    """A round whose validation loss is NaN (its outputs diverged) at the same accuracy as a
    later, finite one: the later round wins. NaN compares false both ways, so before, the NaN
    score stayed selected for good."""
    rounds = [
        [ev("a", 1, 0.5, NAN, test_acc=0.1), ev("b", 1, 0.5, NAN, test_acc=0.1)],
        [ev("a", 2, 0.5, 0.7, test_acc=0.9), ev("b", 2, 0.5, 0.6, test_acc=0.9)],
    ]
    assert kept_rounds(mode, rounds) == {"a": 2, "b": 2}
