"""The server's side of an algorithm: SCAFFOLD's control variates, the server optimizers of
FedAdam, FedYogi and FedAdagrad, their checkpointed state, and how they meet secure aggregation.
On the plain Silo and Server classes, with the heart-disease hospitals' real data."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from plain_federation import aggregate, federation, fit_all, play_round

from silo_pfl.aggregation import weighted_mean
from silo_pfl.algorithms.scaffold import steps_moved
from silo_pfl.config import to_dict
from silo_pfl.errors import ConfigError
from silo_pfl.server_start import new_server
from silo_pfl.silo import Silo
from silo_pfl.split import PrivacyError

HOSPITALS = ("cleveland", "hungarian", "switzerland", "va")


def _assert_c_is_the_mean_of_the_silos(server, silos: list[Silo]) -> None:
    """The server's c is the mean of the N silos' c_i weighted by their training rows, the
    weights of the model's step, so that SCAFFOLD's correction sum_i p_i (c - c_i) cancels in
    it. The hospitals' sizes differ (159, 138, 24 and 68 rows), so the plain mean, which the
    paper's equal weights give and the server kept before, is far from it."""
    server_c = server.broadcast()["control_variate"]
    rows = np.array([s.num_examples for s in silos], np.float64)
    for key in server.global_state():
        c_i = np.stack([s.algorithm.c_local[key].double().numpy() for s in silos])
        mean = np.tensordot(rows / rows.sum(), c_i, axes=1)
        np.testing.assert_allclose(server_c[key], mean, rtol=0, atol=1e-6)
    assert max(float(np.abs(v).max()) for v in server_c.values()) > 1e-3  # it moved
    plain = {k: np.stack([s.algorithm.c_local[k].numpy() for s in silos]).mean(0) for k in server_c}
    assert max(float(np.abs(server_c[k] - plain[k]).max()) for k in plain) > 1e-3


def test_scaffolds_server_control_variate_is_the_mean_of_the_silos_after_each_round(job):
    silos, server = federation(job, "scaffold", silos=HOSPITALS)
    for round_ in (1, 2, 3):
        updates = play_round(silos, server, round_, commit=True)[0]
        assert all(set(u.extras) == {"control_variate"} for u in updates)
        _assert_c_is_the_mean_of_the_silos(server, silos)


@pytest.mark.parametrize(
    ("secure", "later"),
    [
        (False, [("switzerland",), ("cleveland", "va")]),
        (True, [("cleveland", "switzerland", "va"), ("hungarian", "switzerland", "va")]),
    ],
)
def test_scaffolds_control_variate_stays_the_mean_when_few_silos_take_part(job, secure, later):
    """Silos of very different sizes (159, 138, 24 and 68 rows): every silo in round 1, then
    fewer (under secure aggregation, at least its threshold of 3); each round moves c by the
    sum of (n_i / n) Delta c_i of the silos that took part, so c stays the row-weighted mean of
    all four c_i, whichever took part."""
    quorum = "round.min_silos=3" if secure else "round.min_silos=1"
    silos, server = federation(
        job, "scaffold", quorum, f"aggregation.secure={secure}", silos=HOSPITALS
    )
    by_name = {s.name: s for s in silos}
    for round_, names in enumerate([HOSPITALS, *later], start=1):
        taking_part = [by_name[n] for n in names]
        updates = [u for u, _ in fit_all(taking_part, server, round_)]
        assert aggregate(taking_part, server, updates).aggregated
        state = server.global_state()
        for silo in taking_part:
            silo.evaluate(state, round_)
            silo.commit(round_, keep=True)
        _assert_c_is_the_mean_of_the_silos(server, silos)


@pytest.mark.parametrize(("algorithm", "takes_back"), [("scaffold", True), ("fedper", False)])
def test_a_silo_that_dies_after_its_update_was_aggregated_rejoins_with_the_state_it_sent(
    job, algorithm, takes_back
):
    """va's round-2 update is aggregated, then its process dies before it commits round 2. The
    server has added its Delta c_i, so the restarted va takes back the c_i its fit sent (kept
    before the update left) and commits round 2 with it: c stays the mean of the four c_i.
    Before, va rejoined with round 1's c_i and c stayed off that mean for good. An algorithm
    whose server mirrors none of its state (fedper) restores its last commit, as before."""
    overrides = (f"algorithm.name={algorithm}", "round.min_silos=4")
    silos, server = federation(job, algorithm, silos=HOSPITALS)
    play_round(silos, server, 1, commit=True)
    updates = [u for u, _ in fit_all(silos, server, 2)]
    assert aggregate(silos, server, updates).aggregated
    for silo in silos[:-1]:
        silo.evaluate(server.global_state(), 2)
        silo.commit(2, keep=True)
    restarted = Silo(to_dict(job("jobs/heart_disease.yaml", *overrides)), "va")
    data = silos[-1].data
    rejoined = restarted.rejoin(data.input_shape, data.num_classes, {}, 1, None, (2, 1))
    assert rejoined.round == (2 if takes_back else 1)
    silos[-1] = restarted
    for round_ in (3, 4):
        play_round(silos, server, round_, commit=True)
        if takes_back:
            _assert_c_is_the_mean_of_the_silos(server, silos)


@pytest.mark.parametrize("momentum", [0.0, 0.5, 0.9, 0.9999999999, 0.999999999999999])
def test_scaffolds_steps_moved_is_how_far_sgd_moves_under_a_steady_gradient(momentum):
    """The c_i update divides the drift by what K steps of the package's SGD (a fresh momentum
    buffer each round) move per unit gradient; K * lr / (1 - m) was 0.23x of that at K=4."""
    from silo_pfl.optim import SGD

    for steps in (1, 4, 10, 20, 100):
        weight = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
        optimizer = SGD([weight], lr=0.01, momentum=momentum)
        for _ in range(steps):
            weight.grad = torch.ones(3, dtype=torch.float64)
            optimizer.step()
        moved = float(-weight.detach()[0]) / 0.01
        assert steps_moved(steps, momentum) == pytest.approx(moved, rel=1e-12), steps


def test_scaffold_corrects_local_steps_by_the_control_variates(job):
    """Round 2 (control variates non-zero) differs from FedAvg's; round 1 (all zero) does not."""
    scaffold, s_server = federation(job, "scaffold", silos=HOSPITALS)
    fedavg, f_server = federation(job, "fedavg", silos=HOSPITALS)
    same = []
    for round_ in (1, 2):
        a = play_round(scaffold, s_server, round_, commit=True)[0]
        b = play_round(fedavg, f_server, round_, commit=True)[0]
        same.append(
            all(
                np.array_equal(x.delta[k], y.delta[k])
                for x, y in zip(a, b, strict=True)
                for k in x.delta
            )
        )
    assert same == [True, False]


def test_a_scaffold_round_follows_algorithm_one_option_two_written_by_hand(job):
    """Round 2, from the server's x and c and each silo's c_i before it (Karimireddy et al.,
    Alg. 1): the local steps follow g - c_i + c; after K of them (2 epochs of batches of 16)
    c_i+ = c_i - c + (x - y) / (lr * steps_moved(K, m)); the silo sends c_i+ - c_i."""
    silos, server = federation(job, "scaffold", silos=HOSPITALS)
    play_round(silos, server, 1, commit=True)
    x = {k: torch.from_numpy(v.copy()) for k, v in server.global_state().items()}
    c = {k: torch.from_numpy(v.copy()) for k, v in server.broadcast()["control_variate"].items()}
    before = {s.name: {k: v.clone() for k, v in s.algorithm.c_local.items()} for s in silos}
    updates = play_round(silos, server, 2, commit=True)[0]
    for silo, update in zip(silos, updates, strict=True):
        algorithm, n = silo.algorithm, update.num_examples
        c_i = before[silo.name]
        assert algorithm.steps == 2 * -(-n // 16), silo.name
        moved = 0.05 * steps_moved(algorithm.steps, 0.9)
        for key, start in x.items():
            y = start + torch.from_numpy(update.delta[key])
            expected = c_i[key] - c[key] + (start - y) / moved
            torch.testing.assert_close(algorithm.c_local[key], expected, rtol=1e-4, atol=1e-5)
            sent = torch.from_numpy(update.extras["control_variate"][key])
            torch.testing.assert_close(sent, expected - c_i[key], rtol=1e-4, atol=1e-5)
        silo.model.zero_grad()
        steps = algorithm.steps
        algorithm.extra_loss(silo.model, x).backward()
        for name, param in silo.model.named_parameters():
            torch.testing.assert_close(param.grad, c[name] - c_i[name], rtol=0, atol=1e-7)
        assert algorithm.steps == steps  # K counts the optimizer's steps, not the loss's terms
    assert max(float((c[k] - before["va"][k]).abs().max()) for k in c) > 1e-3  # it corrects


@pytest.mark.parametrize("optimizer", ["adam", "yogi", "adagrad"])
def test_one_round_of_a_server_optimizer_equals_the_optimizer_written_by_hand(job, optimizer):
    silos, server = federation(job, f"fed{optimizer}", "server.lr=0.05", silos=HOSPITALS)
    start = {k: v.copy() for k, v in server.global_state().items()}
    updates = play_round(silos, server, 1, commit=True)[0]
    mean = weighted_mean([u.delta for u in updates], [u.num_examples for u in updates])
    lr, beta1, beta2, tau = 0.05, 0.9, 0.99, 1e-3
    for key, mean_delta in mean.items():
        delta = mean_delta.astype(np.float64)  # the optimizer works in float64
        m = (1 - beta1) * delta
        v0 = np.full_like(delta, tau**2)
        v = {
            "adagrad": v0 + delta**2,
            "adam": beta2 * v0 + (1 - beta2) * delta**2,
            "yogi": v0 - (1 - beta2) * delta**2 * np.sign(v0 - delta**2),
        }[optimizer]
        expected = (start[key] + lr * m / (np.sqrt(v) + tau)).astype(np.float32)
        np.testing.assert_array_equal(server.global_state()[key], expected)


def test_two_rounds_of_fedavgm_equal_server_momentum_written_by_hand(job):
    """FedAvgM (Hsu et al., 2019): m = beta1 * m + Delta; x = x + lr * m, m = 0 at the start."""
    silos, server = federation(job, "fedavgm", "server.lr=0.5", "server.beta1=0.8", silos=HOSPITALS)
    x = {k: v.astype(np.float64) for k, v in server.global_state().items()}
    m = {k: np.zeros_like(v) for k, v in x.items()}
    for round_ in (1, 2):
        updates = play_round(silos, server, round_, commit=True)[0]
        mean = weighted_mean([u.delta for u in updates], [u.num_examples for u in updates])
        for key, delta in mean.items():
            m[key] = 0.8 * m[key] + delta.astype(np.float64)
            x[key] = x[key] + 0.5 * m[key]
            np.testing.assert_allclose(server.global_state()[key], x[key], rtol=1e-6, atol=1e-7)
    assert server.optimizer.kind == "momentum" and server.optimizer.m  # it kept its momentum


def test_server_sgd_scales_the_mean_and_combines_with_a_personalized_algorithm(job):
    silos, server = federation(job, "fedper", "server.lr=0.5", silos=HOSPITALS)
    start = {k: v.copy() for k, v in server.global_state().items()}
    updates = play_round(silos, server, 1, commit=True)[0]
    mean = weighted_mean([u.delta for u in updates], [u.num_examples for u in updates])
    assert not any(k.startswith("head.") for k in mean)
    for key, delta in mean.items():
        expected = (start[key].astype(np.float64) + 0.5 * delta).astype(np.float32)
        np.testing.assert_array_equal(server.global_state()[key], expected)


@pytest.mark.parametrize(
    ("algorithm", "overrides"), [("scaffold", ()), ("fedper", ("server.optimizer=yogi",))]
)
def test_the_servers_state_is_checkpointed_and_resumes_bit_exactly(job, algorithm, overrides):
    silos, server = federation(job, algorithm, *overrides, silos=HOSPITALS)
    play_round(silos, server, 1, commit=True)
    play_round(silos, server, 2, commit=True)
    server.checkpoint(2, {})
    play_round(silos, server, 3, commit=True)
    after = server.global_state(), server.broadcast()
    resumed = new_server(to_dict(server.cfg), (13,), 2)
    resumed.resume()
    for silo in silos:
        silo.restore(2)
    play_round(silos, resumed, 3, commit=True)
    for key, value in after[0].items():
        np.testing.assert_array_equal(resumed.global_state()[key], value)
    for name, values in after[1].items():
        for key, value in values.items():
            np.testing.assert_array_equal(resumed.broadcast()[name][key], value)


def test_scaffold_under_secure_aggregation_matches_the_plain_run(job):
    plain, plain_server = federation(job, "scaffold", silos=HOSPITALS)
    secure, secure_server = federation(job, "scaffold", "aggregation.secure=true", silos=HOSPITALS)
    for round_ in (1, 2):
        play_round(plain, plain_server, round_, commit=True)
        updates = play_round(secure, secure_server, round_, commit=True)[0]
        assert all(u.masked is not None and not u.extras and not u.delta for u in updates)
    for name, values in plain_server.broadcast().items():
        for key, value in values.items():
            np.testing.assert_allclose(
                secure_server.broadcast()[name][key], value, rtol=0, atol=1e-5
            )


def test_an_extra_holding_a_local_key_never_leaves_the_silo(job):
    """On the production path: an algorithm whose extra carries a local key makes the silo's
    fit fail, before anything is returned."""
    silos, server = federation(
        job, "leaky_scaffold", "plugins=[tests.strategy_plugins]", "split.local=[head]",
        silos=HOSPITALS,
    )  # fmt: skip
    with pytest.raises(PrivacyError, match="refusing to send local keys in control_variate: head"):
        silos[0].fit(server.global_state(), 1, 1, server.broadcast())


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ("algorithm.name=fedadam", "server.optimizer=yogi"),
            "server.optimizer: got yogi, but algorithm fedadam is fedavg with "
            "server.optimizer=adam; use algorithm.name=fedavg server.optimizer=yogi",
        ),
        (("server.optimizer=rmsprop",), "server.optimizer: got 'rmsprop', expected one of sgd,"),
        (("server.lr=0",), "server.lr: got 0.0, expected a number > 0, or null"),
        (
            ("algorithm.name=scaffold", "train.optimizer=adam"),
            "train.optimizer: got adam, but scaffold's control variates assume SGD steps",
        ),
        (
            (
                "plugins=[tests.strategy_plugins]",
                "algorithm.name=median_fedavg",
                "aggregation.secure=true",
            ),
            "aggregation.secure: algorithm median_fedavg needs each silo's update in the clear",
        ),
    ],
)
def test_strategies_that_cannot_run_refuse_at_load_in_one_line(job, overrides, message):
    with pytest.raises(ConfigError) as info:
        job("jobs/heart_disease.yaml", *overrides)
    assert str(info.value).startswith(message)
    assert "\n" not in str(info.value)
