"""Secure aggregation: real X25519/HKDF/ChaCha20 from `cryptography`; the server learns the sum."""

from __future__ import annotations

import numpy as np
import pytest

from silo_pfl.aggregation import weighted_mean
from silo_pfl.config import to_dict
from silo_pfl.errors import FederationError
from silo_pfl.federation import Federation
from silo_pfl.messages import SiloUpdate
from silo_pfl.secure_aggregation import Masker, decode_mean, encode, masked_sum
from silo_pfl.server import Server
from silo_pfl.silo import Silo

SHAPES = {"body.fc1.weight": (32, 13), "body.fc1.bias": (32,), "head.bias": (2,)}


def _paired(names: list[str]) -> dict[str, Masker]:
    maskers = {name: Masker("fed", name) for name in names}
    keys = {name: m.public_key() for name, m in maskers.items()}
    for masker in maskers.values():
        masker.pair_with(keys)
    return maskers


def _payloads(count: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [
        {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()} for _ in range(count)
    ]


def test_the_masked_sum_is_the_weighted_mean_and_no_single_vector_reveals_its_update():
    names, weights = ["a", "b", "c"], [199, 30, 85]
    maskers, payloads = _paired(names), _payloads(3)
    vectors = [
        maskers[n].mask(p, w, round_=1) for n, p, w in zip(names, payloads, weights, strict=True)
    ]
    mean = decode_mean(masked_sum(vectors), SHAPES)
    expected = weighted_mean(payloads, weights)
    for key in SHAPES:
        np.testing.assert_allclose(mean[key], expected[key], rtol=0, atol=1e-6)
    for vector, payload, weight in zip(vectors, payloads, weights, strict=True):
        plain = encode(payload, weight)
        assert np.abs(plain.view(np.int64)).max() < 2**40  # what an unmasked update looks like
        assert np.mean(vector == plain) < 0.01
        # Masked, every entry is uniform over 2^64: below 2^40 with probability 2^-23.
        assert np.mean(np.abs(vector.view(np.int64)) < 2**40) < 0.01
    # Without one silo's vector the masks do not cancel: the rest decode to noise.
    partial = masked_sum(vectors[:2]).view(np.int64)
    assert np.mean(np.abs(partial) < 2**40) < 0.01


def test_masks_are_fresh_each_round_and_depend_on_the_peers_keys():
    maskers, (payload,) = _paired(["a", "b"]), _payloads(1)
    first = maskers["a"].mask(payload, 10, round_=1)
    second = maskers["a"].mask(payload, 10, round_=2)
    assert np.mean(first == second) < 0.01
    other = _paired(["a", "b"])["a"].mask(payload, 10, round_=1)  # new key pairs
    assert np.mean(first == other) < 0.01


def test_a_retried_round_masks_afresh_and_a_restarted_silo_masks_as_the_same_party():
    maskers, payloads = _paired(["a", "b"]), _payloads(2)
    first = [maskers[n].mask(p, 5, round_=3) for n, p in zip("ab", payloads, strict=True)]
    retry = [
        maskers[n].mask(p, 5, round_=3, attempt=2) for n, p in zip("ab", payloads, strict=True)
    ]
    assert all(np.mean(x == y) < 0.01 for x, y in zip(first, retry, strict=True))
    for vectors in (first, retry):
        mean = decode_mean(masked_sum(vectors), SHAPES)
        np.testing.assert_allclose(
            mean["head.bias"], weighted_mean(payloads, [5, 5])["head.bias"], atol=1e-6
        )
    # A silo restarted from its saved private key pairs again as the same party.
    keys = {n: m.public_key() for n, m in maskers.items()}
    again = Masker("fed", "a", maskers["a"].private_bytes())
    assert again.public_key() == keys["a"]
    again.pair_with(keys)
    assert np.array_equal(again.mask(payloads[0], 5, round_=3), first[0])


def test_a_masker_refuses_a_missing_own_key_a_lone_silo_and_an_unpaired_mask():
    masker, peer = Masker("fed", "a"), Masker("fed", "b")
    with pytest.raises(FederationError, match="silo a: its own public key"):
        masker.pair_with({"a": peer.public_key(), "b": peer.public_key()})
    with pytest.raises(FederationError, match="at least 2 silos"):
        masker.pair_with({"a": masker.public_key()})
    with pytest.raises(FederationError, match="before pair_with"):
        masker.mask(_payloads(1)[0], 1, round_=1)


def test_secure_silos_hand_the_server_only_masked_vectors(job):
    cfg = job("jobs/heart_disease.yaml", "aggregation.secure=true", "algorithm.name=fedavg")
    config = to_dict(cfg)
    silos = [Silo(config, name) for name in ("cleveland", "hungarian", "switzerland", "va")]
    infos = [silo.setup() for silo in silos]
    keys = {info.silo: info.public_key for info in infos}
    assert all(len(key) == 32 for key in keys.values())
    for silo in silos:
        silo.build(infos[0].input_shape, infos[0].num_classes, keys)
    server = Server(config, infos[0].input_shape, infos[0].num_classes)
    start = server.global_state()
    updates = [silo.fit(start, 1)[0] for silo in silos]
    for update in updates:
        assert update.delta == {} and update.num_examples == 0
        assert update.masked is not None and update.masked.dtype == np.uint64
    # The server refuses a plain update outright while secure aggregation is on.
    plain = SiloUpdate("va", 1, 85, {k: np.zeros_like(v) for k, v in start.items()})
    refused = server.aggregate(*updates[:3], plain)
    assert "silo va: aggregation.secure is on" in refused.rejected["va"]
    assert not refused.aggregated and "none from va" in refused.reason
    assert server.aggregate(*updates).aggregated
    new_state = server.global_state()
    # The same silos without masking, trained from the same start, give the same mean.
    plain_cfg = job("jobs/heart_disease.yaml", "algorithm.name=fedavg")
    plain_silos = [Silo(to_dict(plain_cfg), s.name) for s in silos]
    for silo in plain_silos:
        silo.setup()
        silo.build(infos[0].input_shape, infos[0].num_classes)
    plain_updates = [silo.fit(start, 1)[0] for silo in plain_silos]
    expected = weighted_mean(
        [u.delta for u in plain_updates], [u.num_examples for u in plain_updates]
    )
    for key, value in new_state.items():
        np.testing.assert_allclose(value, start[key] + expected[key], rtol=0, atol=1e-6)


@pytest.mark.usefixtures("ray_local")
def test_a_secure_federation_matches_the_plain_one(job):
    """(That two secure runs with fresh keys agree bit for bit is shown by test_faults: a killed
    and resumed secure run equals an uninterrupted one.)"""
    overrides = ("algorithm.name=fedavg", "rounds=3", "tracking.enabled=false")
    plain = Federation(job("jobs/heart_disease.yaml", *overrides)).run()
    secure = [
        Federation(job("jobs/heart_disease.yaml", *overrides, "aggregation.secure=true")).run()
    ]
    a, p = (np.load(r.global_state_path) for r in (*secure, plain))
    for key in p.files:
        np.testing.assert_allclose(a[key], p[key], rtol=0, atol=1e-5)
    assert secure[0].test_accuracies == plain.test_accuracies
    vector_bytes = 8 * (sum(p[k].size for k in p.files) + 1)  # every global value, then weight
    assert {s.bytes_sent_per_round for s in secure[0].silos.values()} == {vector_bytes}
