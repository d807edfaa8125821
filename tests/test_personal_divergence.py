"""A personal model that diverges is never sent, selected, published or registered: a personal
state that is not finite after its training (Ditto's personal model, APFL's v) withholds the
silo's update and rolls the round back; a personalized model that is not finite at evaluation
(fine-tuning) is never selected; a silo left with none ends the run in one line."""

from __future__ import annotations

import dataclasses

import pytest
from mlflow import MlflowClient
from plain_federation import aggregate, federation, fit_all

from silo_pfl.cli import main
from silo_pfl.messages import EvalMetrics
from silo_pfl.selection import MODES, Selector
from silo_pfl.tensor_state import first_not_finite

DITTO_DIVERGES = ("algorithm.ditto.lam=1e4",)
FINETUNE_DIVERGES = ("algorithm.finetune.epochs=40", "train.lr=2")
FINETUNE_THEN_FITS = ("algorithm.finetune.epochs=40", "train.lr=10")  # round 2's fits diverge too


def test_a_personal_model_that_diverges_withholds_the_update_and_is_rolled_back(job):
    silos, server = federation(job, "ditto", *DITTO_DIVERGES, "round.min_silos=1")
    (cleveland, (update, metrics)), (hungarian, (sent, calm)) = zip(
        silos, fit_all(silos, server, 1), strict=True
    )
    assert update is None
    assert metrics.withheld.startswith("its personal training diverged (ditto.personal.")
    assert metrics.withheld.endswith("lower train.lr or the options of algorithm.ditto")
    assert first_not_finite(cleveland.algorithm.local_state()) is not None
    assert sent is not None and not calm.withheld
    assert first_not_finite(hungarian.algorithm.local_state()) is None
    cleveland.algorithm.params = dataclasses.replace(cleveland.algorithm.params, lam=0.1)
    update, metrics = cleveland.fit(server.global_state(), 1, broadcast=server.broadcast())
    assert update is not None and not metrics.withheld, "the round starts again from its commit"
    assert first_not_finite(cleveland.algorithm.local_state()) is None


@pytest.mark.parametrize(("options", "diverges"), [(FINETUNE_DIVERGES, True), ((), False)])
def test_a_personalized_model_that_diverges_at_evaluation_says_so(job, options, diverges):
    silos, server = federation(job, "finetune", *options)
    updates = [update for update, _ in fit_all(silos, server, 1)]
    assert aggregate(silos, server, updates).aggregated
    evals = [silo.evaluate(server.global_state(), 1) for silo in silos]
    if diverges:
        assert all(e.diverged.endswith(" is not finite") for e in evals), evals
    else:
        assert [e.diverged for e in evals] == ["", ""]


@pytest.mark.parametrize("mode", MODES)
def test_a_diverged_model_is_never_selected(mode):
    def ev(silo: str, round_: int, val: float, diverged: str = "") -> EvalMetrics:
        return EvalMetrics(silo, round_, val, 0.5, 0.5, 0.5, diverged=diverged)

    selector = Selector(mode)
    nan = "body.fc1.weight is not finite"
    assert selector.choose([ev("a", 1, 0.0, nan), ev("b", 1, 0.0, nan)], {"a", "b"}) == []
    assert selector.choose([ev("a", 2, 0.7), ev("b", 2, 0.0, nan)], {"a", "b"}) == ["a"]
    assert selector.choose([ev("a", 3, 0.9, nan), ev("b", 3, 0.6)], {"b"}) == ["b"]


@pytest.mark.parametrize(
    ("options", "said"),
    [
        (
            ("algorithm.name=ditto", *DITTO_DIVERGES),
            "needed (round.min_silos); none from cleveland (cleveland: its personal training "
            "diverged (ditto.personal.",
        ),
        (
            ("algorithm.name=ditto", *DITTO_DIVERGES, "round.min_silos=1"),
            "error: silo cleveland: left out of every evaluated round, it has no model to "
            "select; its last update was withheld: its personal training diverged (ditto.personal.",
        ),
        (
            ("algorithm.name=finetune", *FINETUNE_DIVERGES),
            "error: silo cleveland: its personalized model was not finite in every round it was "
            "evaluated (",
        ),
        (
            ("algorithm.name=finetune", *FINETUNE_THEN_FITS, "round.min_silos=1"),
            "so it has none to select; lower train.lr or the options of algorithm.finetune; its "
            "last update was withheld too: training diverged (",
        ),
    ],
    ids=["ditto", "ditto-quorum-of-one", "finetune", "finetune-then-its-fits"],
)
def test_a_run_whose_personal_models_diverge_ends_in_one_line_and_registers_nothing(
    tmp_path, capsys, options, said
):
    store = tmp_path / "mlflow.db"
    argv = ["run", "jobs/heart_disease.yaml", "rounds=2", f"tracking.uri=sqlite:///{store}"]
    argv += [f"output_dir={tmp_path / 'runs'}", *options]
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1
    assert said in err[-1] and "Traceback" not in "\n".join(err)
    assert not list((tmp_path / "runs").rglob("selected/*.pt")), "no model was published"
    assert MlflowClient(f"sqlite:///{store}").search_registered_models() == []
    if "round.min_silos=1" in options or "finetune" in options[0]:  # resumed: the same reason
        assert main([*argv, "--resume"]) == 1
        assert capsys.readouterr().err.strip().splitlines()[-1] == err[-1]
