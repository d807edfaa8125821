"""End-to-end federations on a real local Ray: determinism, FedAvg equals local SGD, results."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from silo_pfl.cli import main
from silo_pfl.data import load_silo_data
from silo_pfl.federation import Federation
from silo_pfl.silo import init_model
from silo_pfl.tensor_state import first_not_finite

pytestmark = pytest.mark.usefixtures("ray_local")

SMALL_DIGITS = (
    "tracking.enabled=false",
    "data.num_silos=3",
    "data.classes_per_silo=4",
    "rounds=2",
    "train.local_epochs=1",
)


def _comparable(result) -> dict:
    """The result without wall-clock timings."""
    data = result.to_dict()
    data.pop("wall_seconds")
    for key in ("global_state_path", "run_id", "run_dir"):
        data.pop(key)
    data.pop("mlflow", None)
    for summary in data["history"]:
        summary.pop("seconds")
        for silo in summary["silos"].values():
            silo.pop("train_seconds")
    return data


def test_same_seed_gives_identical_results(job):
    first = Federation(job("jobs/digits_label_skew.yaml", *SMALL_DIGITS, "seed=3")).run()
    second = Federation(job("jobs/digits_label_skew.yaml", *SMALL_DIGITS, "seed=3")).run()
    other = Federation(job("jobs/digits_label_skew.yaml", *SMALL_DIGITS, "seed=4")).run()
    assert _comparable(first) == _comparable(second)
    a, b = np.load(first.global_state_path), np.load(second.global_state_path)
    assert a.files == b.files and all(np.array_equal(a[k], b[k]) for k in a.files)
    assert _comparable(first) != _comparable(other)


def _one_silo_one_round(job, *overrides: str):
    """Run a 1-silo, 1-round federation of 3 full-batch epochs; return (config, global state)."""
    cfg = job(
        "jobs/digits_label_skew.yaml",
        "tracking.enabled=false",
        "data.num_silos=1",
        "data.partition=iid",
        "rounds=1",
        "train.local_epochs=3",
        "train.batch_size=100000",
        "train.lr=0.1",
        "train.momentum=0",
        *overrides,
    )
    return cfg, np.load(Federation(cfg).run().global_state_path)


def _plain_sgd(cfg, mu: float = 0.0) -> dict[str, np.ndarray]:
    """The same 3 full-batch steps with torch.optim.SGD, plus (mu / 2) * ||w - w0||^2."""
    data = load_silo_data(cfg.data, "silo_0", cfg.seed)
    model = init_model(cfg, data.input_shape, data.num_classes)
    start = [p.detach().clone() for p in model.parameters()]
    x, y = torch.from_numpy(data.x_train), torch.from_numpy(data.y_train)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        prox = sum((p - p0).pow(2).sum() for p, p0 in zip(model.parameters(), start, strict=True))
        (loss + 0.5 * mu * prox).backward()
        optimizer.step()
    return {k: v.numpy() for k, v in model.state_dict().items()}


def test_fedavg_one_silo_one_round_equals_plain_local_sgd(job):
    cfg, federated = _one_silo_one_round(job, "algorithm.name=fedavg")
    plain = _plain_sgd(cfg)
    assert set(federated.files) == set(plain)
    for key in plain:
        np.testing.assert_allclose(federated[key], plain[key], rtol=1e-5, atol=1e-6)
    # The update really moved the weights: the comparison is not between two initial models.
    data = load_silo_data(cfg.data, "silo_0", cfg.seed)
    initial = init_model(cfg, data.input_shape, data.num_classes).state_dict()
    assert not np.allclose(federated["head.weight"], initial["head.weight"].numpy())


def test_fedprox_adds_its_proximal_term_to_the_shared_loop(job):
    cfg, federated = _one_silo_one_round(job, "algorithm.name=fedprox", "algorithm.fedprox.mu=5")
    with_prox, without = _plain_sgd(cfg, mu=5.0), _plain_sgd(cfg)
    for key in with_prox:
        np.testing.assert_allclose(federated[key], with_prox[key], rtol=1e-5, atol=1e-6)
    # The term matters at this mu: FedProx's update is not FedAvg's.
    assert not np.allclose(with_prox["body.conv1.weight"], without["body.conv1.weight"], atol=1e-4)


def test_cli_run_writes_results_json(tmp_path, capsys):
    out = tmp_path / "results.json"
    code = main(
        [
            "run",
            "jobs/heart_disease.yaml",
            "rounds=2",
            "tracking.enabled=false",
            f"output_dir={tmp_path / 'runs'}",
            "--results",
            str(out),
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "round 2/2" in printed and "mean test accuracy" in printed
    summary = json.loads(out.read_text())
    for field in ("algorithm", "rounds", "seed", "wall_seconds", "mean_test_accuracy"):
        assert field in summary
    assert summary["algorithm"] == "fedper" and summary["rounds"] == 2
    assert summary["global_parameters"] == 13 * 32 + 32
    assert summary["local_parameters"] == 32 * 2 + 2
    sizes = {
        name: (s["num_train"], s["num_val"], s["num_test"]) for name, s in summary["silos"].items()
    }
    assert sizes == {  # rows trained on, validation rows apart: 199, 172, 30, 85 in all
        "cleveland": (159, 40, 104),
        "hungarian": (138, 34, 89),
        "switzerland": (24, 6, 16),
        "va": (68, 17, 45),
    }
    accuracies = [s["test_accuracy"] for s in summary["silos"].values()]
    assert summary["mean_test_accuracy"] == pytest.approx(np.mean(accuracies))
    for silo in summary["silos"].values():
        assert silo["bytes_sent_per_round"] == 4 * (13 * 32 + 32)
        assert 0 < silo["num_val"] < silo["num_train"]
    assert "cleveland         159    40   104" in printed  # the table's train, val and test rows


def test_local_algorithm_sends_nothing(job):
    result = Federation(
        job("jobs/heart_disease.yaml", "algorithm.name=local", "rounds=2", "tracking.enabled=false")
    ).run()
    assert result.global_parameters == 0
    assert all(s.bytes_sent_per_round == 0 for s in result.silos.values())
    assert all(r.silos[n]["bytes_sent"] == 0 for r in result.history for n in r.silos)


def test_bad_csv_file_is_one_clear_error_through_ray(tmp_path, capsys):
    good = tmp_path / "a.csv"
    good.write_text("x1,x2,label\n" + "\n".join(f"{i},{i % 3},{i % 2}" for i in range(40)))
    code = main(
        [
            "run",
            "jobs/heart_disease.yaml",
            "data.source=csv",
            "data.num_classes=2",
            "tracking.enabled=false",
            f"data.paths.alpha={good}",
            f"data.paths.beta={tmp_path / 'missing.csv'}",
            f"output_dir={tmp_path / 'runs'}",
        ]
    )
    err = capsys.readouterr().err.strip()
    assert code != 0
    assert err.count("\n") == 0 and "Traceback" not in err
    assert "silo beta" in err and "missing.csv" in err


def test_a_dead_silo_actor_is_reported_by_name(job):
    import ray

    from silo_pfl.config import to_dict
    from silo_pfl.errors import FederationError
    from silo_pfl.runtime.actors import get, start_silo, stop

    cfg = job("jobs/heart_disease.yaml", "tracking.enabled=false")
    actor = start_silo(cfg, to_dict(cfg), "hungarian", "test")
    ray.kill(actor.host, no_restart=True)  # dead for good: a restart would bring it back
    with pytest.raises(FederationError) as info:
        get(actor.setup.remote(), "silo set-up")
    stop([actor])
    message = str(info.value)
    assert message.startswith("silo set-up: silo hungarian died (")
    assert "\n" not in message


def test_diverged_training_is_one_clear_error_naming_the_silo(tmp_path, capsys):
    code = main(
        [
            "run",
            "jobs/heart_disease.yaml",
            "train.lr=1e6",
            "rounds=3",
            "tracking.enabled=false",
            f"output_dir={tmp_path / 'runs'}",
        ]
    )
    err = capsys.readouterr().err.strip()
    assert code != 0
    assert err.count("\n") == 0 and "Traceback" not in err
    assert err.startswith("error: round 1: no quorum after 3 attempts (round.retries=2)")
    assert " needed (round.min_silos); none from " in err
    assert ", va: training diverged (body." in err, "silos with one reason are named together"
    assert "lower train.lr" in err


def test_a_tensor_is_diverged_only_if_a_value_is_nan_or_infinite_not_if_its_sum_overflows():
    """The divergence check sums first; a sum that overflows from finite values is no divergence."""
    big = torch.full((4,), 3e38)  # finite, but its float32 sum is inf
    state = {"a": torch.zeros(3), "b": big, "c": torch.arange(5), "d": torch.ones(2)}
    assert first_not_finite(state) is None
    for bad in (float("nan"), float("inf"), -float("inf")):
        value = torch.ones(6)
        value[4] = bad
        assert first_not_finite({**state, "d": value}) == "d"
    assert first_not_finite({"x": torch.tensor([float("inf"), -float("inf")])}) == "x"
    each_finite = {"p": torch.tensor([3e38]), "q": torch.tensor([3e38])}  # their sums' sum is inf
    assert first_not_finite(each_finite) is None


@pytest.mark.parametrize("mode", ["best_val", "best_mean_val"])
def test_each_silo_keeps_the_round_its_validation_chose_through_ray(job, mode):
    """The round runner tells each silo, through its worker, whether to keep this round's model:
    the selected model is the validation-best round of the history, not the last one."""
    result = Federation(
        job(
            "jobs/heart_disease.yaml",
            "tracking.enabled=false",
            "algorithm.name=fedavg",
            "rounds=6",
            "train.lr=0.5",
            f"eval.selection={mode}",
        )
    ).run()
    val = {silo: [s.silos[silo]["val_accuracy"] for s in result.history] for silo in result.silos}
    test = {silo: [s.silos[silo]["test_accuracy"] for s in result.history] for silo in result.silos}
    if mode == "best_val":
        best = {silo: max(v) for silo, v in val.items()}
        assert any(v[-1] < best[silo] for silo, v in val.items()), "every last round is best"
        for silo, outcome in result.silos.items():
            assert val[silo][outcome.selected_round - 1] == best[silo] == outcome.val_accuracy
    else:
        means = [s.mean_val_accuracy for s in result.history]
        assert means[-1] < max(means), "the last round is the best: the test shows nothing"
        rounds = {outcome.selected_round for outcome in result.silos.values()}
        assert len(rounds) == 1 and means[rounds.pop() - 1] == max(means)
    for silo, outcome in result.silos.items():
        assert outcome.test_accuracy == test[silo][outcome.selected_round - 1]


def test_the_global_state_a_run_keeps_is_the_selected_rounds(job, monkeypatch):
    """Where every silo selected one round (best_mean_val, last), the run's global state (what
    MLflow logs as the global layers, and what a silo joining later freezes) is that round's,
    the global keys of every silo's selected model; not the last round's. Round 1 is chosen
    here, four rounds before the last: its server checkpoint is kept for it."""
    from silo_pfl import checkpoint
    from silo_pfl.run_dir import silo_dir
    from silo_pfl.selection import Selector
    from silo_pfl.silo_store import SELECTED

    monkeypatch.setattr(
        Selector,
        "choose",
        lambda self, evals, unselected=(): [e.silo for e in evals if e.round == 1],
    )
    cfg = job(
        "jobs/heart_disease.yaml", "tracking.enabled=false", "algorithm.name=fedavg", "rounds=5"
    )
    result = Federation(cfg).run()
    assert {outcome.selected_round for outcome in result.silos.values()} == {1}
    kept = dict(np.load(result.global_state_path))
    for silo in result.silos:
        model = checkpoint.load(silo_dir(cfg, result.run_id, silo) / SELECTED, 1)
        for key, value in kept.items():
            assert np.array_equal(model[key].numpy(), value), (silo, key)
