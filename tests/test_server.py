"""The server rejects, with a named reason, any update it must not aggregate, and goes on with
the others while they make a quorum (round.min_silos)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from silo_pfl.config import to_dict
from silo_pfl.messages import SiloUpdate
from silo_pfl.server import Server
from silo_pfl.server_start import new_server
from silo_pfl.silo import Silo


def _round_one(job, *overrides: str) -> tuple[Server, list[SiloUpdate]]:
    """A server for the four hospitals and two hospitals' real updates for round 1."""
    config = to_dict(job("jobs/heart_disease.yaml", *overrides))
    updates = []
    for name in ("hungarian", "va"):
        silo = Silo(config, name)
        info = silo.setup()
        silo.build(info.input_shape, info.num_classes)
        server = new_server(config, info.input_shape, info.num_classes)
        updates.append(silo.fit(server.global_state(), 1, broadcast=server.broadcast())[0])
    return server, updates


def _fresh(server: Server) -> Server:
    """Another server of the same federation, at round 0."""
    return new_server(to_dict(server.cfg), (13,), 2)


@pytest.fixture
def round_one(job):
    """Hungarian's and va's updates; a quorum of one."""
    return _round_one(job, "round.min_silos=1")


def _nan(update: SiloUpdate) -> SiloUpdate:
    key = next(iter(update.delta))
    bad = update.delta[key].copy()
    bad.flat[0] = np.nan
    return dataclasses.replace(update, delta={**update.delta, key: bad})


def _infinities(update: SiloUpdate) -> SiloUpdate:
    """+inf and -inf in one key: their sum is NaN, not an infinity."""
    key = next(iter(update.delta))
    bad = update.delta[key].copy()
    bad.flat[:2] = (np.inf, -np.inf)
    return dataclasses.replace(update, delta={**update.delta, key: bad})


def _float64(update: SiloUpdate) -> SiloUpdate:
    return dataclasses.replace(
        update, delta={k: v.astype(np.float64) for k, v in update.delta.items()}
    )


@pytest.mark.parametrize(
    ("forge", "reason"),
    [
        (lambda u: dataclasses.replace(u, round=2), "for round 2, but round 1 is being aggregated"),
        (
            lambda u: dataclasses.replace(u, silo="mallory"),
            "not a silo of this federation (its silos are cleveland,",
        ),
        (_nan, "body.fc1.weight is not finite"),
        (_infinities, "body.fc1.weight is not finite"),
        (_float64, "is float64, expected float32"),
    ],
)
def test_a_bad_update_is_rejected_with_its_reason_and_the_round_goes_on(round_one, forge, reason):
    server, (hungarian, va) = round_one
    start = {k: v.copy() for k, v in server.global_state().items()}
    bad = forge(hungarian)
    report = server.aggregate(bad, va)
    assert reason in report.rejected[bad.silo]
    assert report.rejected[bad.silo].startswith(f"update from silo {bad.silo}: ")
    assert report.aggregated and report.accepted == ("va",)
    alone = _fresh(server)
    alone.aggregate(va)
    for key, value in server.global_state().items():
        assert np.array_equal(value, alone.global_state()[key]), "the bad update changed a key"
    assert not np.array_equal(server.global_state()["body.fc1.weight"], start["body.fc1.weight"])


def test_a_duplicate_is_rejected_and_a_replay_next_round_too(round_one):
    server, (hungarian, va) = round_one
    report = server.aggregate(hungarian, hungarian, va)
    assert report.rejected == {
        "hungarian": "update from silo hungarian: a second update this round"
    }
    assert report.accepted == ("hungarian", "va") and server.round == 1
    replay = server.aggregate(hungarian)
    assert "for round 1, but round 2 is being aggregated" in replay.rejected["hungarian"]
    assert not replay.aggregated and server.round == 1


def test_without_a_quorum_nothing_changes_and_the_missing_silos_are_named(job):
    server, (hungarian, va) = _round_one(job, "round.min_silos=3")
    before = {k: v.copy() for k, v in server.global_state().items()}
    report = server.aggregate(hungarian, va)
    assert not report.aggregated and server.round == 0
    assert (
        report.reason == "2 updates, 3 needed (round.min_silos); none from cleveland, switzerland"
    )
    assert all(np.array_equal(before[k], v) for k, v in server.global_state().items())


def test_an_update_over_the_norm_bound_is_rejected(job):
    _, (hungarian, va) = _round_one(job, "round.min_silos=1")
    norms = {
        u.silo: float(np.sqrt(sum(np.sum(v.astype(np.float64) ** 2) for v in u.delta.values())))
        for u in (hungarian, va)
    }
    bound = (norms["hungarian"] + norms["va"]) / 2
    larger = max(norms, key=norms.get)
    bound_key = f"aggregation.max_update_norm={bound}"
    bounded_cfg = job("jobs/heart_disease.yaml", "round.min_silos=1", bound_key)
    bounded = new_server(to_dict(bounded_cfg), (13,), 2)
    report = bounded.aggregate(hungarian, va)
    assert f"exceeds aggregation.max_update_norm={bound:g}" in report.rejected[larger]
    assert report.accepted == tuple(n for n in ("hungarian", "va") if n != larger)


def test_the_norm_bound_measures_float_values_not_batchnorms_step_count(job):
    """A shared BatchNorm's update holds its step count (the silo's local steps): measured in, it
    outweighed the rest, so the bound rejected silos for their rows and epochs. Two silos of 159
    and 30 rows, five epochs, a bound 1.5 times the larger one's float values: both are
    accepted. Its running statistics are measured: a running variance pushed far is rejected."""
    from plain_federation import federation as plain_federation
    from plain_federation import fit_all

    overrides = ("model.name=cnn_small_bn", "train.local_epochs=5", "round.min_silos=1")
    silos, server = plain_federation(
        job, "fedavg", *overrides, silos=("silo_5", "silo_8"), path="jobs/digits_dirichlet.yaml"
    )
    updates = [update for update, _ in fit_all(silos, server, 1)]

    def norm(update, keys) -> float:
        return float(np.sqrt(sum(np.sum(update.delta[k].astype(np.float64) ** 2) for k in keys)))

    floats = [k for k, v in server.state.items() if v.dtype.kind == "f"]
    assert any(k.endswith("num_batches_tracked") for k in set(server.state) - set(floats))
    bound = 1.5 * max(norm(u, floats) for u in updates)
    assert max(norm(u, server.state) for u in updates) > bound  # the step count alone exceeds it
    config = job(
        "jobs/digits_dirichlet.yaml",
        "algorithm.name=fedavg",
        *overrides,
        f"aggregation.max_update_norm={bound}",
    )
    bounded = new_server(to_dict(config), silos[0].data.input_shape, silos[0].num_classes)
    report = bounded.aggregate(*updates)
    assert report.rejected == {} and report.accepted == ("silo_5", "silo_8")
    (variance,) = [k for k in floats if k.endswith("running_var")][:1]
    pushed = dataclasses.replace(
        updates[1], round=2, delta={**updates[1].delta, variance: updates[1].delta[variance] - 1e6}
    )
    assert "exceeds aggregation.max_update_norm" in bounded.aggregate(pushed).rejected["silo_8"]


def _norm(values) -> float:
    return float(np.sqrt(sum(np.sum(v.astype(np.float64) ** 2) for v in values.values())))


def test_scaffolds_control_variate_change_has_a_bound_of_its_own(job):
    """SCAFFOLD's control-variate change travels beside the delta and moves the server's c,
    which every silo trains with: one silo's pushed far wrecked every silo's next round, and no
    bound measured it. aggregation.max_extra_norm does; max_update_norm still bounds the delta
    alone (the change is a gradient's size, a delta's over lr times the steps: a bound sized for
    deltas rejected honest small silos)."""
    scaffold = ("algorithm.name=scaffold", "round.min_silos=1", "train.lr=0.005")
    _, updates = _round_one(job, *scaffold)
    hungarian, va = updates
    (name,) = hungarian.extras
    deltas = max(_norm(u.delta) for u in updates)
    extras = min(_norm(u.extras[name]) for u in updates)
    assert extras > 1.5 * deltas  # a small step: the change is larger than the delta
    deltas_bounded = job(
        "jobs/heart_disease.yaml", *scaffold, f"aggregation.max_update_norm={1.5 * deltas}"
    )
    assert new_server(to_dict(deltas_bounded), (13,), 2).aggregate(*updates).rejected == {}
    extras = max(_norm(u.extras[name]) for u in updates)
    config = job("jobs/heart_disease.yaml", *scaffold, f"aggregation.max_extra_norm={1.5 * extras}")
    bounded = new_server(to_dict(config), (13,), 2)
    assert bounded.aggregate(*updates).accepted == ("hungarian", "va")
    pushed = {k: v + 1e6 for k, v in hungarian.extras[name].items()}
    report = _fresh(bounded).aggregate(dataclasses.replace(hungarian, extras={name: pushed}), va)
    assert report.rejected["hungarian"].startswith(f"update from silo hungarian: {name} norm")
    assert f"exceeds aggregation.max_extra_norm={1.5 * extras:g}" in report.rejected["hungarian"]
    assert report.accepted == ("va",)


def test_a_selected_round_whose_checkpoint_is_gone_gives_the_last_rounds_state_and_says_so(
    job, tmp_path, caplog
):
    """A run resumed from a version that did not keep the selected round's checkpoint: its end
    keeps the last round's global keys, with a warning, where it failed after every round."""
    import io
    import logging

    config = to_dict(job("jobs/heart_disease.yaml", f"output_dir={tmp_path}"))
    server = new_server(config, (13,), 2)
    server.checkpoint(0, {})
    with caplog.at_level(logging.WARNING, logger="silo_pfl.server"):
        kept = np.load(io.BytesIO(server.state_bytes(3)))
    assert all(np.array_equal(kept[k], v) for k, v in server.global_state().items())
    assert "round-000003" in caplog.text
    assert "the run keeps the last round's global keys instead" in caplog.text
