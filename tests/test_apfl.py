"""APFL on the plain Silo and Server classes: the global model is FedAvg's, the silo is judged by
alpha * v + (1 - alpha) * w, and neither v nor alpha leaves the silo."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from plain_federation import federation, play_round, same_updates

from silo_pfl.algorithms.base import Phase
from silo_pfl.config import to_dict
from silo_pfl.errors import ConfigError
from silo_pfl.silo import Silo
from silo_pfl.training import evaluate


def test_alpha_zero_is_fedavgs_global_model(job):
    apfl, apfl_server = federation(job, "apfl", "algorithm.apfl.alpha=0")
    fedavg, fedavg_server = federation(job, "fedavg")
    for round_ in (1, 2):
        a_updates, _, a_evals = play_round(apfl, apfl_server, round_, commit=True)
        f_updates, _, f_evals = play_round(fedavg, fedavg_server, round_, commit=True)
        assert same_updates(a_updates, f_updates)
        assert a_evals == f_evals
    assert all(silo.algorithm.personal is not None for silo in apfl)


def test_alpha_one_is_the_personal_model_trained_alone(job):
    silos, server = federation(job, "apfl", "algorithm.apfl.alpha=1")
    silo = silos[0]
    alone = copy.deepcopy(silo.model)  # the initial model, before any round
    phase = Phase("all", silo.algorithm.params.personal_epochs)
    for round_ in (1, 2, 3):
        _, _, evals = play_round(silos, server, round_, commit=True)
        silo.train(alone, phase, round_, None, purpose="apfl")
        val, test = evaluate(alone, *silo.val_xy), evaluate(alone, *silo.test_xy)
        assert (evals[0].val_accuracy, evals[0].val_loss) == (val.accuracy, val.loss)
        assert (evals[0].test_accuracy, evals[0].test_loss) == (test.accuracy, test.loss)
    # It is not the global model the silo holds.
    assert evaluate(silo.model, *silo.val_xy).loss != evals[0].val_loss


def test_learned_alpha_moves_and_stays_in_the_unit_interval(job):
    def alphas(alpha_lr: str) -> list[float]:
        silos, server = federation(
            job, "apfl", "algorithm.apfl.alpha=learned", f"algorithm.apfl.alpha_lr={alpha_lr}"
        )
        seen = []
        for round_ in (1, 2, 3):
            play_round(silos, server, round_, commit=True)
            seen += [silo.algorithm.alpha for silo in silos]
            assert [silo.algorithm.report() for silo in silos] == [
                {"alpha": silo.algorithm.alpha} for silo in silos
            ]
        return seen

    moved = alphas("0.01")
    assert all(0 < a < 1 for a in moved) and len(set(moved)) == len(moved)
    pushed = alphas("100")  # steps far past the ends: projected back onto [0, 1]
    assert all(0 <= a <= 1 for a in pushed) and {0.0, 1.0} & set(pushed)


def test_grid_picks_the_alpha_with_the_best_validation_accuracy(job):
    silos, server = federation(job, "apfl", "algorithm.apfl.alpha=grid")
    for round_ in (1, 2):
        _, _, evals = play_round(silos, server, round_, commit=True)
    for silo, result in zip(silos, evals, strict=True):
        personal, w = silo.algorithm.personal.state_dict(), silo.model.state_dict()
        scores = {}
        for alpha in silo.algorithm.params.grid:
            mixed = copy.deepcopy(silo.model)
            mixed.load_state_dict({k: alpha * personal[k] + (1 - alpha) * w[k] for k in w})
            score = evaluate(mixed, *silo.val_xy)
            scores[alpha] = (score.accuracy, -score.loss)
        assert len({s[0] for s in scores.values()}) > 1  # the choice matters
        best = max(scores, key=scores.__getitem__)
        assert silo.algorithm.alpha == best
        assert result.val_accuracy == scores[best][0]
        assert result.val_loss == pytest.approx(-scores[best][1], rel=1e-5)
        assert silo.outcome().extras == {"alpha": best}


@pytest.mark.parametrize(
    "privacy",
    [
        ["privacy.central_models=global_only"],
        ["privacy.central_models=none"],
        [
            "silos.cleveland.tracking_uri=sqlite:///c.db",
            "silos.hungarian.tracking_uri=sqlite:///h.db",
        ],
    ],
)
def test_alpha_leaves_a_silo_only_where_its_personalized_model_goes(job, privacy):
    """alpha is a part of the silo's personalized model: it reaches the driver (and the central
    store, the results) only under privacy.central_models=full for a silo without its own store;
    the test above shows it then."""
    silos, server = federation(job, "apfl", *privacy)
    play_round(silos, server, 1, commit=True)
    for silo in silos:
        assert silo.outcome().extras == {}, silo.name


@pytest.mark.parametrize("alpha", ["grid", "learned"])
def test_local_state_round_trip_restores_identical_evaluations(job, alpha):
    silos, server = federation(job, "apfl", f"algorithm.apfl.alpha={alpha}")
    for round_ in (1, 2):
        _, state, _ = play_round(silos, server, round_, commit=True)
    original = silos[0]
    restored = Silo(to_dict(original.cfg), original.name)
    info = restored.setup(resume=True)
    restored.build(info.input_shape, info.num_classes)
    restored.restore(2)
    assert restored.algorithm.alpha == original.algorithm.alpha
    assert restored.evaluate(state, 2) == original.evaluate(state, 2)
    a_update, _ = restored.fit(state, 3)
    b_update, _ = original.fit(state, 3)
    assert same_updates([a_update], [b_update])
    assert restored.algorithm.alpha == original.algorithm.alpha
    assert restored.evaluate(state, 3) == original.evaluate(state, 3)


def test_nothing_sent_holds_the_personal_model_or_alpha(job):
    apfl, apfl_server = federation(job, "apfl", "algorithm.apfl.alpha=learned")
    fedavg, fedavg_server = federation(job, "fedavg")
    for round_ in (1, 2):
        a_updates, _, _ = play_round(apfl, apfl_server, round_, commit=True)
        f_updates, _, _ = play_round(fedavg, fedavg_server, round_, commit=True)
        assert same_updates(a_updates, f_updates)  # only w's update, as FedAvg's
    sent = [v for u in a_updates for v in u.delta.values()]
    assert set(a_updates[0].delta) == set(apfl[0].split.global_keys)
    for silo in apfl:
        assert 0 < silo.algorithm.alpha < 1
        assert not any(np.isin(silo.algorithm.alpha, s).any() for s in sent)
        for value in silo.algorithm.personal.state_dict().values():
            assert not any(
                s.shape == value.shape and np.array_equal(s, value.numpy()) for s in sent
            )
    assert not torch.equal(
        apfl[0].algorithm.personal.state_dict()["head.weight"],
        apfl[0].model.state_dict()["head.weight"],
    )


@pytest.mark.parametrize("value", ["sometimes", "1.5", "-0.1", "nan"])
def test_a_bad_alpha_is_a_one_line_config_error(job, value):
    with pytest.raises(ConfigError, match=r"^algorithm\.apfl\.alpha: ") as info:
        job("jobs/heart_disease.yaml", "algorithm.name=apfl", f"algorithm.apfl.alpha={value}")
    assert "\n" not in str(info.value) and "learned, grid" in str(info.value)


def test_each_silos_alpha_is_a_key_of_its_entry_in_the_results_json(tmp_path):
    from silo_pfl.results import FederationResult, SiloResult

    silo = SiloResult(0.8, 0.9, 3, 0.8, 10, 2, 2, 64, extras={"alpha": 0.3})
    result = FederationResult("f", "apfl", 3, 0, 1.0, 10, 5, {"va": silo}, [])
    result.write_json(tmp_path / "result.json")
    entry = json.loads((tmp_path / "result.json").read_text())["silos"]["va"]
    assert entry["alpha"] == 0.3 and "extras" not in entry
