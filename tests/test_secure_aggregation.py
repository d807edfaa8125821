"""Secure aggregation with real Ed25519, X25519, HKDF, AES-CTR and ChaCha20-Poly1305 from
`cryptography`: the sum is the weighted mean, dropouts are recovered, a lying driver is caught,
and what the server sees is indistinguishable from noise."""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from plain_federation import aggregate, federation, fit_all
from scipy import stats
from secure_protocol import confirmed, pairings, run_round, unmask_request
from secure_protocol import federation as protocol_federation

from silo_pfl.aggregation import weighted_mean
from silo_pfl.cli import main
from silo_pfl.errors import FederationError, SiloPflError
from silo_pfl.federation import Federation
from silo_pfl.messages import SiloUpdate
from silo_pfl.secure import identity, prg, shamir
from silo_pfl.secure.aggregator import SecureAggregator, SecureRoundError
from silo_pfl.secure.client import SecureClient
from silo_pfl.secure.fixed_point import decode_mean, encode
from silo_pfl.secure.messages import Advertisement, UnmaskRequest
from silo_pfl.secure.prg import BLOCK_WORDS, CHUNK_WORDS, apply_streams, stream
from silo_pfl.secure.topology import default_threshold, graph_seed, harary, topology

SHAPES = {"body.fc1.weight": (32, 13), "body.fc1.bias": (32,), "head.bias": (2,)}
HOSPITALS = ("cleveland", "hungarian", "switzerland", "va")
HEART = "jobs/heart_disease.yaml"


def _payloads(names, seed: int = 0) -> dict[str, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return {n: {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()} for n in names}


def _weights(names, seed: int = 1) -> dict[str, int]:
    rng = np.random.default_rng(seed)
    return {n: int(rng.integers(1, 1000)) for n in names}


def modular_sum(vectors) -> np.ndarray:
    """What the server would see adding masked vectors without unmasking them."""
    total = vectors[0].copy()
    for vector in vectors[1:]:
        total += vector
    return total


def _assert_mean_of(total, payloads, weights, names) -> None:
    mean = decode_mean(total, SHAPES)
    expected = weighted_mean([payloads[n] for n in names], [weights[n] for n in names])
    for key in SHAPES:
        np.testing.assert_allclose(mean[key], expected[key], rtol=0, atol=1e-6)


@pytest.mark.parametrize("count", [2, 3, 10, 25])
@pytest.mark.parametrize("neighbors", [None, "log"], ids=["full-mesh", "secagg+"])
def test_the_unmasked_sum_is_the_weighted_mean(count, neighbors):
    k = None if neighbors is None else int(np.ceil(np.log2(count))) + 1
    _, clients, server = protocol_federation(count, k)
    payloads, weights = _payloads(clients, count), _weights(clients, count)
    total, vectors = run_round(clients, server, payloads, weights)
    _assert_mean_of(total, payloads, weights, list(clients))
    if k is not None and k < count - 1:
        assert {len(p) for p in server.topology.peers.values()} <= {k, k + 1}
    # The masks alone do not cancel: the plain sum of the masked vectors is noise.
    plain = modular_sum(list(vectors.values())).view(np.int64)
    assert np.mean(np.abs(plain[:-1]) < 2**40) < 0.01


@pytest.mark.parametrize(
    ("neighbors", "drops"),
    [
        (None, {"after_masking": ["s03"]}),
        (None, {"after_masking": ["s03", "s07"]}),
        (None, {"before_masking": ["s05"]}),
        (None, {"before_sharing": ["s01"], "before_masking": ["s05"], "after_masking": ["s08"]}),
        (6, {"before_masking": ["s02"], "after_masking": ["s09"]}),
    ],
    ids=["after-1", "after-2", "before-1", "every-step", "secagg+"],
)
def test_dropouts_are_recovered_and_the_survivors_sum_is_exact(neighbors, drops):
    """A silo lost after sending its masked vector is in the sum (its self mask is rebuilt from
    its peers' shares); one lost before is not (its pairwise masks are rebuilt from its mask
    key's shares)."""
    _, clients, server = protocol_federation(10, neighbors)
    payloads, weights = _payloads(clients), _weights(clients)
    total, vectors = run_round(clients, server, payloads, weights, **drops)
    lost_early = set(drops.get("before_sharing", [])) | set(drops.get("before_masking", []))
    assert set(vectors) == set(clients) - lost_early
    _assert_mean_of(total, payloads, weights, sorted(vectors))


def test_below_the_threshold_a_round_fails_at_every_step_and_nothing_is_unmasked():
    params, clients, server = protocol_federation(6)  # threshold ceil(12/3) = 4
    assert params.threshold == default_threshold(6) == 4
    payloads, weights = _payloads(clients), _weights(clients)
    names = list(clients)
    adverts = [clients[n].advertise(1, 1) for n in names]
    with pytest.raises(SecureRoundError, match=r"3 silos at key advertisement, fewer than .*=4"):
        server.enroll(1, 1, adverts[:3])
    # Two silos lost after masking, one before: 3 of 6 could confirm the unmask request, 4
    # signatures are needed, so none reveals a share.
    with pytest.raises(FederationError, match=r"only 3 survivors signed .*secure_threshold=4"):
        run_round(
            clients, server, payloads, weights, round_=2, before_masking=["s05"],
            after_masking=["s01", "s02"],
        )  # fmt: skip
    # Two lost once they had confirmed it: 3 of 6 reveal, 4 shares are needed.
    _, clients, server = protocol_federation(6)
    with pytest.raises(SecureRoundError, match=r"shares of silo s0\d's .* arrived, 4 needed"):
        run_round(
            clients, server, payloads, weights, before_masking=["s05"],
            after_confirming=["s01", "s02"],
        )  # fmt: skip
    _, clients, server = protocol_federation(6)
    with pytest.raises(SecureRoundError, match="3 silos at masked input"):
        run_round(clients, server, payloads, weights, before_masking=["s00", "s01", "s02"])


def _lying_setup():
    params, clients, server = protocol_federation(10)
    adverts = [c.advertise(1, 1) for c in clients.values()]
    server.enroll(1, 1, adverts)
    return params, clients, server, adverts


def test_a_driver_that_substitutes_a_key_is_caught_and_named():
    params, clients, _, adverts = _lying_setup()
    victim = clients["s00"]
    driver_key = Ed25519PrivateKey.generate()
    forged = dataclasses.replace(adverts[1], mask_key=adverts[0].mask_key)
    with pytest.raises(FederationError, match="silo s01: its round keys are not signed by its"):
        victim.share_keys([adverts[0], forged, *adverts[2:]])
    resigned = dataclasses.replace(
        forged, signature=driver_key.sign(forged.signed_bytes(params.federation))
    )
    with pytest.raises(FederationError, match="silo s01: its round keys are not signed by its"):
        victim.share_keys([adverts[0], resigned, *adverts[2:]])
    stranger = Advertisement("mallory", 1, 1, adverts[1].cipher_key, adverts[1].mask_key)
    with pytest.raises(FederationError, match="silo mallory: not a silo of federation fed"):
        victim.share_keys([*adverts, stranger])
    altered_own = dataclasses.replace(adverts[0], cipher_key=adverts[1].cipher_key)
    with pytest.raises(FederationError, match="silo s00: its round keys are not signed"):
        victim.share_keys([altered_own, *adverts[1:]])
    # A byte moved from one key to the other keeps the signed bytes, and the signature, intact.
    whole = adverts[1].cipher_key + adverts[1].mask_key
    shifted = dataclasses.replace(adverts[1], cipher_key=whole[:33], mask_key=whole[33:])
    assert shifted.signed_bytes(params.federation) == adverts[1].signed_bytes(params.federation)
    with pytest.raises(
        FederationError, match="silo s01: its round keys are not two 32-byte X25519 keys"
    ):
        victim.share_keys([adverts[0], shifted, *adverts[2:]])


def _runs_of_one_federation(count: int):
    """Fresh runs of one federation whose silos keep their identity keys (as they do between
    runs): each call masks round 1 and returns the clients, the server and the unmask request
    in which the last silo dropped after masking."""
    params, _, _ = protocol_federation(count)
    names = list(params.silos)
    keys = {name: Ed25519PrivateKey.generate() for name in names}
    trusted = {name: identity.public_bytes(key) for name, key in keys.items()}
    payloads, weights = _payloads(names), _weights(names)

    def masked_run():
        clients = {name: SecureClient(params, name, keys[name], trusted) for name in names}
        server = SecureAggregator(params, trusted)
        adverts = [clients[n].advertise(1, 1) for n in names]
        server.enroll(1, 1, adverts)
        inbox = server.route([clients[n].share_keys(adverts) for n in names])
        for name in names:
            clients[name].mask(payloads[name], weights[name], 1, 1, inbox[name])
        return clients, server, unmask_request(clients, names[:-1], names[-1:])

    return params, masked_run


def test_confirmations_from_an_earlier_run_of_the_federation_do_not_count():
    """Identity keys outlive runs, and each run counts rounds and attempts from 1: a driver
    that kept survivors' signatures of a request in one run could replay them in the next, and
    gather the threshold for requests no quorum confirmed (a silo's update unmasked alone)."""
    params, masked_run = _runs_of_one_federation(4)  # threshold 3
    earlier, _, old = masked_run()
    kept = {name: earlier[name].confirm(old) for name in old.survivors}
    now, _, request = masked_run()
    assert request.signed_bytes(params.federation) == old.signed_bytes(params.federation)
    first = request.survivors[0]
    signatures = {**kept, first: now[first].confirm(request)}
    with pytest.raises(FederationError, match=rf"silo {first}: only 1 survivors signed"):
        now[first].unmask(dataclasses.replace(request, signatures=tuple(signatures.items())))


def test_a_pairing_from_an_earlier_run_of_the_federation_is_refused():
    """A survivor's signed pairing (the peers it masked with) kept from one run would, replayed
    in the next, tell the silos that the survivors' masks tie them into one sum when they may
    not."""
    _, masked_run = _runs_of_one_federation(4)
    *_, old = masked_run()
    now, server, request = masked_run()
    second = request.survivors[1]
    replayed = tuple(old.pairings[1] if p.silo == second else p for p in request.pairings)
    with pytest.raises(SecureRoundError, match=rf"pairing of survivor {second} is not its signed"):
        server.unmask_request(request.survivors, {p.silo: p for p in replayed})
    first = request.survivors[0]
    with pytest.raises(FederationError, match=rf"pairing of survivor {second} is not its signed"):
        now[first].confirm(dataclasses.replace(request, pairings=replayed))
    assert now[first].confirm(request)


def test_a_driver_that_shows_a_silo_an_earlier_runs_keys_of_its_far_silos_is_caught():
    """SecAgg+ (7 silos, 2 neighbours, threshold 5): a silo needs fresh shares only from its
    neighbours, so a driver could show it the earlier run's advertisements of the others, then
    their earlier pairings and confirmations, which were signed over those same keys: with one
    signature of this run the victim revealed. Every signature now covers all the attempt's
    advertisements, the victim's own fresh keys among them."""
    params, _, _ = protocol_federation(7, neighbors=2)
    names = list(params.silos)
    keys = {name: Ed25519PrivateKey.generate() for name in names}
    trusted = {name: identity.public_bytes(key) for name, key in keys.items()}
    payloads, weights = _payloads(names), _weights(names)
    victim = names[0]

    def masked_run(shown=None):
        clients = {name: SecureClient(params, name, keys[name], trusted) for name in names}
        server = SecureAggregator(params, trusted)
        adverts = {n: clients[n].advertise(1, 1) for n in names}
        server.enroll(1, 1, list(adverts.values()))
        views = {n: list(adverts.values()) for n in names} | (shown(adverts) if shown else {})
        inbox = server.route([clients[n].share_keys(views[n]) for n in names])
        for name in names:
            clients[name].mask(payloads[name], weights[name], 1, 1, inbox[name])
        return clients, server, adverts

    earlier, plan, old_adverts = masked_run()
    far = [n for n in names if n != victim and n not in plan.topology.peers[victim]]
    old = unmask_request(earlier, names)
    kept = {name: earlier[name].confirm(old) for name in far}

    def mixed(adverts):
        return {victim: [old_adverts[n] if n in far else adverts[n] for n in names]}

    now, _, _ = masked_run(mixed)
    request = unmask_request(now, names)
    shown = dataclasses.replace(
        request,
        pairings=tuple(
            old.pairings[names.index(p.silo)] if p.silo in far else p for p in request.pairings
        ),
    )
    with pytest.raises(FederationError, match=rf"^silo {victim}: the pairing of survivor s0\d"):
        now[victim].confirm(shown)
    signatures = {victim: b"", **kept}
    with pytest.raises(FederationError, match=rf"^silo {victim}: asked to unmask .* another"):
        now[victim].unmask(dataclasses.replace(shown, signatures=tuple(signatures.items())))


def test_a_driver_that_shrinks_the_peer_set_is_caught():
    _, clients, _, adverts = _lying_setup()
    with pytest.raises(
        FederationError,
        match=r"silo s00: the round's peer set has 2 silos \(s00, s01\), fewer than "
        r"aggregation.secure_threshold=7; refusing to share keys",
    ):
        clients["s00"].share_keys(adverts[:2])


def _masked_round(
    count: int,
    k: int,
    left_out: frozenset[str] = frozenset(),
    part: set[str] | None = None,
    lost: frozenset[str] = frozenset(),
):
    """A SecAgg+ round to its masked input: the coordinator relays no key of `left_out`, and
    delivers each silo only the shares of silos on its side of `part` (None: all of them); the
    silos of `lost` share keys and are lost before masking; every other silo masks (with
    `_payloads` and `_weights`). Returns the parameters, the clients, the server and the
    maskers."""
    params, clients, server = protocol_federation(count, neighbors=k)
    names = sorted(clients)
    enrolled = [n for n in names if n not in left_out]
    payloads, weights = _payloads(clients), _weights(clients)
    adverts = [clients[n].advertise(1, 1) for n in names]
    relayed = [a for a in adverts if a.silo in enrolled]
    server.enroll(1, 1, relayed)
    inbox = server.route([clients[n].share_keys(relayed) for n in enrolled])
    if part is not None:
        side = {n: part if n in part else set(names) - part for n in names}
        inbox = {n: {s: c for s, c in box.items() if s in side[n]} for n, box in inbox.items()}
    maskers = [n for n in enrolled if n not in lost]
    for name in maskers:
        clients[name].mask(payloads[name], weights[name], 1, 1, inbox[name])
    return params, clients, server, maskers


def test_a_driver_that_shows_silos_different_survivor_sets_unmasks_nothing_of_one_silo():
    """SecAgg+ (N = 10, k = 3, t = 7): to strip silo B's masks a coordinator needs B's
    self-mask seed from B's holders, its neighbours, told that B survived, and the neighbours'
    mask keys from silos told that they dropped. It shows each neighbour a request in which it
    survived and the other silos one in which the neighbours dropped. The others refuse theirs:
    B, cut off from every other survivor, would be unmasked alone. Each neighbour signs the one
    request it is shown, which gathers one signature: no one reveals anything of B."""
    params, clients, server, names = _masked_round(10, 3)
    plan, victim = server.topology, names[0]
    neighbours = set(plan.peers[victim])
    shown = {}
    for name in names:  # each silo its own story
        dropped = tuple(sorted(neighbours - {name}))
        shown[name] = unmask_request(clients, sorted(set(names) - set(dropped)), dropped)
    signatures = {}
    for name in names:
        if name in neighbours:
            signatures[name] = clients[name].confirm(shown[name])
            continue
        with pytest.raises(FederationError, match=rf"^silo {name}: the survivors' masks split"):
            clients[name].confirm(shown[name])
    assert len(names) - len(neighbours) >= params.threshold  # the lie would have had its quorum
    for name in neighbours:
        request = dataclasses.replace(shown[name], signatures=((name, signatures[name]),))
        with pytest.raises(FederationError, match=rf"silo {name}: only 1 survivors signed"):
            clients[name].unmask(request)


@pytest.mark.parametrize(
    ("count", "k", "left_out", "part"),
    [
        (12, 3, {"s00", "s02", "s04", "s11"}, None),
        (12, 5, set(), {"s01", "s02", "s03", "s04", "s05", "s08"}),
    ],
    ids=["silos-left-out", "shares-withheld-across-a-cut"],
)
def test_survivors_whose_masks_split_them_into_parts_are_unmasked_by_no_one(
    count, k, left_out, part
):
    """SecAgg+'s graph, with silos left out of the round (or genuinely lost), or a coordinator
    that withholds the shares between two halves, can split the survivors into parts whose
    masks cancel within each: each part's sum would be unmasked on its own. Every survivor
    signs the peers it masked with; the server will not ask, and no silo confirms."""
    _, clients, server, survivors = _masked_round(count, k, frozenset(left_out), part)
    with pytest.raises(SecureRoundError, match=r"masks split them into parts \(.* apart from"):
        server.unmask_request(survivors, pairings(clients, survivors))
    request = unmask_request(clients, survivors)
    for name in survivors:
        with pytest.raises(FederationError, match=rf"^silo {name}: the survivors' masks split"):
            clients[name].confirm(request)


def test_a_round_whose_survivors_cannot_rebuild_a_seed_fails_before_anyone_reveals():
    """SecAgg+ (N = 10, k = 5: a secret is rebuilt from 5 of its 6 holders), two silos lost
    after sharing their keys, before masking: a survivor's seed has 4 holders left among the
    survivors. The server sees it in the signed pairings and asks for no reveal, so the round's
    next attempt, with fresh keys, still has every silo (one that revealed would refuse it)."""
    _, clients, server, alive = _masked_round(10, 5, lost=frozenset({"s00", "s01"}))
    names, payloads, weights = sorted(clients), _payloads(clients), _weights(clients)
    with pytest.raises(SecureRoundError, match=r"4 survivors hold shares of silo s\d+'s self-mask"):
        server.unmask_request(alive, pairings(clients, alive))
    total, _ = run_round(clients, server, payloads, weights, attempt=2)
    mean = decode_mean(total, SHAPES)
    expected = weighted_mean([payloads[n] for n in names], [weights[n] for n in names])
    for key in SHAPES:
        np.testing.assert_allclose(mean[key], expected[key], rtol=0, atol=1e-6)


def test_a_pairing_a_driver_withheld_or_altered_is_refused():
    """A full mesh of 4, one silo's shares to another withheld one way: those two disagree on
    whether they paired. A pairing altered (or another silo's) is not its silo's signed one."""
    _, clients, server = protocol_federation(4)
    names = sorted(clients)
    payloads, weights = _payloads(clients), _weights(clients)
    adverts = [c.advertise(1, 1) for c in clients.values()]
    server.enroll(1, 1, adverts)
    inbox = server.route([clients[n].share_keys(adverts) for n in names])
    del inbox["s01"]["s00"]  # s01 never sees s00's shares; s00 pairs with s01 all the same
    for name in names:
        clients[name].mask(payloads[name], weights[name], 1, 1, inbox[name])
    with pytest.raises(SecureRoundError, match="survivor s00 paired with s01, but not back"):
        server.unmask_request(names, pairings(clients, names))
    with pytest.raises(FederationError, match="^silo s02: survivor s00 paired with s01, but not"):
        clients["s02"].confirm(unmask_request(clients, names))
    honest = unmask_request(clients, names)
    forged = dataclasses.replace(honest.pairings[1], peers=("s00", "s02", "s03"))
    altered = dataclasses.replace(
        honest, pairings=(honest.pairings[0], forged, *honest.pairings[2:])
    )
    with pytest.raises(FederationError, match="pairing of survivor s01 is not its signed one"):
        clients["s03"].confirm(altered)
    missing = dataclasses.replace(honest, pairings=honest.pairings[1:])
    with pytest.raises(FederationError, match="^silo s03: no signed pairing of survivor s00;"):
        clients["s03"].confirm(missing)


def test_a_replayed_round_is_refused_at_every_step():
    _, clients, server, adverts = _lying_setup()
    a = clients["s00"]
    with pytest.raises(FederationError, match="silo s00: asked to advertise round 1 attempt 1"):
        a.advertise(1, 1)
    bundles = [c.share_keys(adverts) for c in clients.values()]
    with pytest.raises(FederationError, match="silo s00: refuses to share keys twice"):
        a.share_keys(adverts)
    inbox = server.route(bundles)
    payload = _payloads(["x"])["x"]
    a.mask(payload, 5, 1, 1, inbox["s00"])
    with pytest.raises(FederationError, match="refuses to mask round 1 attempt 1 twice"):
        a.mask(payload, 7, 1, 1, inbox["s00"])
    names = tuple(sorted(clients))
    for name in names[1:]:
        clients[name].mask(payload, 5, 1, 1, inbox[name])
    with pytest.raises(FederationError, match="asked for both secrets of s03"):
        a.confirm(UnmaskRequest(1, 1, names, ("s03",)))
    request = unmask_request(clients, names)
    signatures = [("s00", a.confirm(request))]
    with pytest.raises(FederationError, match="refuses to confirm a second unmask request"):
        a.confirm(unmask_request(clients, names[:-1], names[-1:]))
    for name in names[1:]:
        signatures.append((name, clients[name].confirm(request)))
    other = dataclasses.replace(
        unmask_request(clients, names[:-1], names[-1:]), signatures=tuple(signatures)
    )
    with pytest.raises(FederationError, match="for another survivor set than the one it confirmed"):
        a.unmask(other)
    a.unmask(dataclasses.replace(request, signatures=tuple(signatures)))
    with pytest.raises(FederationError, match="refuses to unmask round 1 attempt 1 twice"):
        a.unmask(unmask_request(clients, names[:-1], names[-1:]))
    # Round 1's keys offered again in round 2 are refused by the peers.
    fresh = [c.advertise(2, 1) for c in clients.values()]
    with pytest.raises(FederationError, match="silo s00: its keys are for round 1 attempt 1"):
        clients["s01"].share_keys([adverts[0], *fresh[1:]])


def test_a_retried_attempt_masks_afresh():
    """Attempt 1 fails after masking, before any silo reveals a share; attempt 2 masks with
    fresh keys and gives the sum exactly."""
    _, clients, server = protocol_federation(3)
    payloads, weights = _payloads(clients), _weights(clients)
    adverts = [c.advertise(1, 1) for c in clients.values()]
    server.enroll(1, 1, adverts)
    inbox = server.route([c.share_keys(adverts) for c in clients.values()])
    masked_first = {n: c.mask(payloads[n], weights[n], 1, 1, inbox[n]) for n, c in clients.items()}
    again, masked_again = run_round(clients, server, payloads, weights, attempt=2)
    _, others, other_server = protocol_federation(3)
    assert np.array_equal(again, run_round(others, other_server, payloads, weights)[0])
    for name in clients:
        assert np.mean(masked_first[name] == masked_again[name]) < 0.01


def test_a_round_once_unmasked_is_not_masked_again_in_another_attempt():
    """Two sums of the same updates, the second without one silo, would give that silo's update
    by difference: once a silo has revealed its shares for a round, no later attempt of it."""
    _, clients, server = protocol_federation(3)
    payloads, weights = _payloads(clients), _weights(clients)
    run_round(clients, server, payloads, weights, attempt=1)
    for name, client in clients.items():
        with pytest.raises(FederationError) as caught:
            client.advertise(1, 2)
        assert str(caught.value) == (
            f"silo {name}: asked to advertise round 1 attempt 2, but it revealed its shares for "
            "round 1 attempt 1: a second sum of the same updates, without some silo, would give "
            "that silo's update away"
        )
    run_round(clients, server, payloads, weights, round_=2)  # the next round is its own


def test_the_server_takes_one_masked_vector_per_silo_that_shared_keys():
    _, clients, server, adverts = _lying_setup()
    names = sorted(clients)
    bundles = [clients[n].share_keys(adverts) for n in names[:-1]]  # s09 never shares
    with pytest.raises(SecureRoundError, match="silo s00: shares not expected"):
        server.route([bundles[0], *bundles])
    server.route(bundles)
    with pytest.raises(ValueError, match="silo s09: not among the silos that shared keys"):
        server.check("s09", 1, 1)
    with pytest.raises(ValueError, match="masked for round 1 attempt 2, not round 1 attempt 1"):
        server.check("s00", 1, 2)


def _chi_square_p(vector: np.ndarray) -> float:
    counts = np.bincount(np.frombuffer(vector.tobytes(), dtype=np.uint8), minlength=256)
    return float(stats.chisquare(counts).pvalue)


def test_what_the_server_sees_is_indistinguishable_from_uniform():
    """A masked vector alone, and the sum of all but one, against uniform bytes (chi-square)
    and against the true update (correlation); the plain encoding fails both checks."""
    _, clients, server = protocol_federation(4)
    rng = np.random.default_rng(7)
    shapes = {"w": (40_000,)}
    payloads = {n: {"w": rng.normal(size=40_000)} for n in clients}
    weights = dict.fromkeys(clients, 100)
    adverts = [c.advertise(1, 1) for c in clients.values()]
    server.enroll(1, 1, adverts)
    inbox = server.route([c.share_keys(adverts) for c in clients.values()])
    masked = {n: c.mask(payloads[n], 100, 1, 1, inbox[n]) for n, c in clients.items()}
    plain = encode(payloads["s00"], 100, 4, "s00")
    assert _chi_square_p(plain) < 1e-12  # sanity: the check sees structure when there is one
    assert _chi_square_p(masked["s00"]) > 1e-6
    partial = modular_sum([masked[n] for n in ("s00", "s01", "s02")])
    assert _chi_square_p(partial) > 1e-6
    truth = plain.view(np.int64)[:-1].astype(np.float64)
    for seen in (masked["s00"], partial):
        r = np.corrcoef(seen.view(np.int64)[:-1].astype(np.float64), truth)[0, 1]
        assert abs(r) < 6 / np.sqrt(truth.size)  # 6 standard errors of a zero correlation
    assert np.corrcoef(truth, truth)[0, 1] > 0.99
    request = confirmed(clients, server.unmask_request(list(masked), pairings(clients, masked)))
    total = server.unmask(masked, [c.unmask(request) for c in clients.values()])
    _assert_weighted(total, payloads, weights, shapes)


def _assert_weighted(total, payloads, weights, shapes) -> None:
    mean = decode_mean(total, shapes)
    expected = weighted_mean(list(payloads.values()), list(weights.values()))
    np.testing.assert_allclose(mean["w"], expected["w"], rtol=0, atol=1e-6)


def test_shamir_any_threshold_of_the_shares_recover_the_secret_and_fewer_do_not():
    secret = bytes(range(32))
    shares = shamir.split(secret, 4, [1, 2, 3, 4, 5, 6])
    assert shamir.combine({x: shares[x] for x in (2, 3, 5, 6)}, 4) == secret
    assert shamir.combine({x: shares[x] for x in (1, 4, 5, 6)}, 4) == secret
    with pytest.raises(ValueError, match="3 shares, 4 needed"):
        shamir.combine({x: shares[x] for x in (1, 2, 3)}, 4)
    wrong = {x: shares[x] for x in (1, 2, 3)} | {4: (shares[4] + 1) % shamir.PRIME}
    assert shamir.combine(wrong, 4) != secret  # three shares and a guess reveal nothing


def test_secagg_plus_graph_is_regular_and_fixed_for_the_federation():
    names = [f"s{i:02d}" for i in range(25)]
    graph = harary(names, 6)
    assert {len(v) for v in graph.values()} == {6}
    assert all(a in graph[b] for a in names for b in graph[a])  # undirected
    seed = graph_seed("fed", names)
    first = topology(names, names, seed, 17, 6)
    assert first.threshold == 5  # ceil(7 * 17 / 25): a majority of its 7 holders
    assert topology(names, names, graph_seed("fed", names), 17, 6) == first
    assert topology(names, names, graph_seed("other", names), 17, 6).peers != first.peers
    odd = harary(names, 5)  # 25 vertices, odd k: raised to 6
    assert {len(v) for v in odd.values()} == {6}
    # Whichever silos' keys a coordinator relays, a silo's peers are its neighbours in the one
    # graph, and its secrets need as many shares as with every neighbour.
    for some in (names[:20], names[3:21], names[::2] + names[1:9:2]):
        part = topology(names, some, seed, 17, 6)
        assert all(part.peers[a] == first.peers[a] & set(some) for a in some)
        assert part.threshold == first.threshold


def test_a_coordinator_that_leaves_out_a_silos_neighbours_draws_it_no_new_peers():
    """Before, the graph was drawn over the silos whose keys were relayed, so a coordinator that
    left some out drew it again, and could so pair a silo with colluders (58 of 60 tries in an
    audit, against 3 when it relayed every key). Now the silo's peers are its neighbours that
    were relayed; with too few of them to hold its secrets it refuses to share keys, and with
    too few that shared theirs it refuses to mask."""
    params, clients, server = protocol_federation(10, 4)  # threshold 7: 4 shares of 5 holders
    payloads, weights = _payloads(clients), _weights(clients)
    names = sorted(clients)
    plan = topology(names, names, params.graph_seed, params.threshold, 4)
    target = "s00"
    left_out = sorted(plan.peers[target])[:2]
    adverts = [c.advertise(1, 1) for c in clients.values()]
    relayed = [a for a in adverts if a.silo not in left_out]
    server.enroll(1, 1, relayed)
    assert server.topology is not None
    assert server.topology.peers[target] == plan.peers[target] - set(left_out)
    with pytest.raises(FederationError, match=r"silo s00: only 2 of its neighbours are in the"):
        clients[target].share_keys(relayed)
    # Its neighbours relayed, but two of them never send their shares: it will not mask.
    params, clients, server = protocol_federation(10, 4)
    adverts = [c.advertise(1, 1) for c in clients.values()]
    server.enroll(1, 1, adverts)
    bundles = [clients[n].share_keys(adverts) for n in names if n not in left_out]
    inbox = server.route(bundles)
    with pytest.raises(FederationError, match=r"silo s00: only 2 peers shared keys; 3 are needed"):
        clients[target].mask(payloads[target], weights[target], 1, 1, inbox[target])


def test_a_value_outside_the_fixed_point_range_is_an_error_naming_the_silo_and_the_bound():
    """The line names the silo and the bound, and quotes no value of the update: it reaches the
    driver, which secure aggregation keeps the update from."""
    payload = {"w": np.array([1.0, 3e9])}
    with pytest.raises(
        FederationError, match=r"silo va: its weighted .* < 2.75e\+10 for 10"
    ) as info:
        encode(payload, 100, 10, "va")
    assert "3e+09" not in str(info.value) and "3e+11" not in str(info.value)
    with pytest.raises(
        FederationError, match=r"not finite\); set aggregation.clip, or lower train.lr$"
    ):
        encode(payload, 100, 10, "va")
    too_wide = (
        r"finite\); lower aggregation.clip below 2.75e\+08 for this silo's 100 rows, or lower"
    )
    with pytest.raises(FederationError, match=too_wide):  # a clip already set: what it must be
        encode(payload, 100, 10, "va", clip=1e9)
    clipped = encode(payload, 100, 10, "va", clip=2.0)
    assert decode_mean(clipped, {"w": (2,)})["w"].tolist() == [1.0, 2.0]
    with pytest.raises(FederationError, match="silo va: its weighted update leaves .* not finite"):
        encode({"w": np.array([np.nan])}, 1, 2, "va")


def test_mask_streams_are_uniform_and_keyed():
    a, b = stream(b"k" * 32, 100_000), stream(b"l" * 32, 100_000)
    assert not np.array_equal(a, b) and np.array_equal(a, stream(b"k" * 32, 100_000))
    assert _chi_square_p(a) > 1e-6


@pytest.mark.parametrize("engine", sorted(prg.ENGINES))
def test_a_mask_stream_is_aes_256_gcm_encrypting_zeros_a_nonce_a_chunk(engine, monkeypatch):
    """The key stream is AES-256's counter mode as GCM runs it, keyed by the whole 32-byte key:
    chunk c of the vector is AES-256-GCM's ciphertext of zeros under the nonce c, its tag
    dropped (words little-endian). Both engines make exactly these words."""
    monkeypatch.setattr(prg, "engine", lambda: engine)
    key, length = bytes(range(32)), 2 * CHUNK_WORDS + 7
    expected = b"".join(
        AESGCM(key).encrypt(c.to_bytes(12, "big"), bytes(8 * size), None)[:-16]
        for c, size in enumerate((CHUNK_WORDS, CHUNK_WORDS, 7))
    )
    assert stream(key, length).astype("<u8").tobytes() == expected


def test_each_process_makes_its_masks_with_the_engine_it_timed_faster():
    timings = {"gcm": [3.0, 1.0, 2.0], "ctr": [1.5, 1.5, 1.5]}  # each engine's tries, in turn
    assert prg.faster(lambda name: timings[name].pop(0)) == "gcm"  # the least of its tries
    assert prg.faster({"gcm": 2.0, "ctr": 1.0}.get) == "ctr"
    assert prg.faster({"gcm": 1.0, "ctr": 1.0}.get) == "gcm"
    assert prg.engine() in prg.ENGINES and prg.engine() == prg.engine()


@pytest.mark.parametrize(
    "length", [1, BLOCK_WORDS - 1, 8 * BLOCK_WORDS, CHUNK_WORDS + 1, 3 * CHUNK_WORDS + 5]
)
def test_masks_removed_on_threads_are_the_same_words(length):
    """Each slice is whole chunks, each chunk's streams under its own nonce: any number of
    threads adds exactly the words one thread adds."""
    rng = np.random.default_rng(length)
    keys = [(bytes(rng.integers(0, 256, 32, dtype=np.uint8)), sign) for sign in (1, -1, 1)]
    start = rng.integers(0, 2**63, length, dtype=np.uint64)
    plus = [rng.integers(0, 2**63, length, dtype=np.uint64) for _ in range(2)]
    once = start.copy()
    apply_streams(once, keys, plus=plus)
    assert not np.array_equal(once, start)
    for threads in (2, 3, 16):
        sliced = start.copy()
        apply_streams(sliced, keys, plus=plus, threads=threads)
        np.testing.assert_array_equal(sliced, once)
    with pytest.raises(ValueError, match="32 bytes"):
        apply_streams(start, [(b"short", 1)], threads=2)


def test_secure_silos_hand_the_server_only_masked_vectors_and_it_checks_them(job):
    secure = ("aggregation.secure=true", "round.min_silos=3")
    silos, server = federation(job, "fedavg", *secure, silos=HOSPITALS)
    start = {k: v.copy() for k, v in server.global_state().items()}
    fits = fit_all(silos, server, 1)
    updates = [update for update, _ in fits]
    for update, metrics in fits:
        assert update.delta == {} and update.num_examples == 0 and not update.extras
        assert update.masked is not None and update.masked.dtype == np.uint64
        # Its masked vector, its round keys and its sealed shares: all it sent.
        assert metrics.bytes_sent > update.masked.nbytes
    plain = SiloUpdate("va", 1, 85, {k: np.zeros_like(v) for k, v in start.items()})
    refused = server.aggregate(*updates[:3], plain)
    assert "silo va: aggregation.secure is on" in refused.rejected["va"]
    assert refused.unmask is not None and refused.unmask.survivors == HOSPITALS[:3]
    request = confirmed({s.name: s for s in silos[:3]}, refused.unmask)
    server.unmask(*[s.unmask(request) for s in silos[:3]])  # unmasks round 1 (3 silos)
    # va's vector of round 1, replayed in round 2 before any keys were shared, is refused.
    late = dataclasses.replace(updates[3], round=2)
    refused = server.aggregate(late).rejected["va"]
    assert refused.endswith("masked for round 2 attempt 1, not round 1 attempt 1")
    plain_silos, plain_server = federation(job, "fedavg", silos=HOSPITALS)
    plain_fits = fit_all(plain_silos, plain_server, 1)
    expected = weighted_mean(
        [u.delta for u, _ in plain_fits[:3]], [u.num_examples for u, _ in plain_fits[:3]]
    )
    for key, value in server.global_state().items():
        np.testing.assert_allclose(value, start[key] + expected[key], rtol=0, atol=1e-6)


def test_a_whole_secure_round_on_the_silo_and_server_classes(job):
    silos, server = federation(job, "fedavg", "aggregation.secure=true", silos=HOSPITALS)
    report = aggregate(silos, server, [u for u, _ in fit_all(silos, server, 1)])
    assert report.aggregated and report.accepted == HOSPITALS and report.secure_seconds > 0


def _identities(tmp_path, names) -> tuple[dict[str, str], str]:
    """A key directory per silo, and the operator's file of their public keys."""
    dirs, lines = {}, []
    for name in names:
        folder = tmp_path / "keys" / name
        key = identity.create(folder)
        dirs[name] = str(folder)
        lines.append(f"{name} {identity.encode_public(identity.public_bytes(key))}")
    path = tmp_path / "identities.txt"
    path.write_text("# distributed out of band\n" + "\n".join(lines) + "\n")
    return dirs, str(path)


def test_configured_identities_are_checked_by_each_silo_and_the_server(job, tmp_path):
    dirs, keys_file = _identities(tmp_path, HOSPITALS)
    options = [f"silos.{n}.key_dir={d}" for n, d in dirs.items()]
    silos, server = federation(
        job, "fedavg", "aggregation.secure=true", f"aggregation.identity_keys={keys_file}",
        *options, silos=HOSPITALS,
    )  # fmt: skip
    report = aggregate(silos, server, [u for u, _ in fit_all(silos, server, 1)])
    assert report.aggregated
    # The driver cannot pass off keys of its own for va: every silo checks the listed key.
    impostor = identity.create(tmp_path / "impostor")
    silos[3]._identity = impostor
    silos[3]._secure._identity = impostor
    adverts = [s.advertise(2, 1) for s in silos]
    with pytest.raises(FederationError, match="silo va: its round keys are not signed"):
        server.enroll(2, 1, adverts)
    with pytest.raises(FederationError, match="silo va: its round keys are not signed"):
        silos[0].share_keys(adverts)
    # A silo whose key directory holds another key refuses to start.
    wrong = [*options[:3], f"silos.va.key_dir={tmp_path / 'impostor'}"]
    with pytest.raises(SiloPflError, match="silo va: its identity key is not the one the config"):
        federation(
            job, "fedavg", "aggregation.secure=true", f"aggregation.identity_keys={keys_file}",
            *wrong, silos=HOSPITALS,
        )  # fmt: skip
    # A key directory that is a file is named, with its key, before any key is read or made.
    (tmp_path / "a_file").write_text("")
    blocked = [*options[:3], f"silos.va.key_dir={tmp_path / 'a_file'}"]
    with pytest.raises(SiloPflError) as info:
        federation(
            job, "fedavg", "aggregation.secure=true", f"aggregation.identity_keys={keys_file}",
            *blocked, silos=HOSPITALS,
        )  # fmt: skip
    assert str(info.value) == (
        f"silo va: key directory {tmp_path / 'a_file'} (silos.va.key_dir): is a file, expected a "
        "directory"
    )


def test_keys_init_makes_a_key_once_and_show_prints_it(tmp_path, capsys):
    where = ["--federation", "fed", "--silo", "va", "--key-dir", str(tmp_path / "va")]
    assert main(["keys", "init", *where]) == 0
    created = capsys.readouterr().out.splitlines()
    assert created[1].startswith("silos.va.identity_key=")
    assert (tmp_path / "va" / identity.PRIVATE_FILE).stat().st_mode & 0o777 == 0o600
    assert main(["keys", "show", *where]) == 0
    assert capsys.readouterr().out.splitlines() == created[1:]
    assert main(["keys", "init", *where]) == 1
    assert capsys.readouterr().err == (
        f"error: {tmp_path}/va/{identity.PRIVATE_FILE}: an identity key exists already and is "
        f"never replaced; silo-pfl keys show {' '.join(where)} prints its public key\n"
    )
    missing = ["--federation", "fed", "--silo", "x", "--key-dir", str(tmp_path / "x")]
    assert main(["keys", "show", *missing]) == 1
    assert capsys.readouterr().err == (
        f"error: {tmp_path}/x/{identity.PRIVATE_FILE}: no identity key; create it with "
        f"silo-pfl keys init {' '.join(missing)}\n"
    )


def test_silos_making_one_identity_at_once_all_get_the_same_whole_key(tmp_path):
    """Two runs of one federation on a node may make a silo's key at once: one key wins, whole."""
    threads = 4
    for attempt in range(40):
        directory, barrier = tmp_path / str(attempt), threading.Barrier(threads)

        def make(directory=directory, barrier=barrier) -> bytes:
            barrier.wait()
            return identity.public_bytes(identity.load_or_create(directory))

        with ThreadPoolExecutor(threads) as pool:
            keys = list(pool.map(lambda _: make(), range(threads)))
        assert keys == [identity.public_bytes(identity.load(directory))] * threads
        assert [p.name for p in directory.iterdir()] == [identity.PRIVATE_FILE]


@pytest.mark.usefixtures("ray_local")
@pytest.mark.parametrize(
    "graph", [[], ["aggregation.secure_graph.neighbors=2"]], ids=["mesh", "k2"]
)
def test_a_secure_federation_matches_the_plain_one(job, graph):
    """The masks cancel exactly: fresh keys every round, the same global state; also when each
    hospital pairs with only 2 of the 3 others (SecAgg+)."""
    overrides = ("algorithm.name=fedavg", "rounds=3", "tracking.enabled=false")
    plain = Federation(job(HEART, *overrides)).run()
    secure = Federation(job(HEART, *overrides, "aggregation.secure=true", *graph)).run()
    a, p = (np.load(r.global_state_path) for r in (secure, plain))
    for key in p.files:
        np.testing.assert_allclose(a[key], p[key], rtol=0, atol=1e-5)
    assert secure.test_accuracies == plain.test_accuracies
    vector_bytes = 8 * (sum(p[k].size for k in p.files) + 1)  # every global value, then weight
    assert {s.bytes_sent_per_round for s in secure.silos.values()} == {vector_bytes}


def test_identity_key_errors_name_the_silo_or_the_file(job, tmp_path):
    _, keys_file = _identities(tmp_path, HOSPITALS)
    text = Path(keys_file).read_text()
    va_key = text.splitlines()[-1].split()[1]
    bad = tmp_path / "bad.txt"
    bad.write_text(text.replace(va_key, "not-base64!"))
    with pytest.raises(SiloPflError, match=r"identity_keys \(.*bad.txt\), silo va: not an Ed25519"):
        job(HEART, "aggregation.secure=true", f"aggregation.identity_keys={bad}")
    bad.write_text(text + "mallory AAAA\n")
    with pytest.raises(SiloPflError, match="bad.txt lists mallory, not a silo of this federation"):
        job(HEART, "aggregation.secure=true", f"aggregation.identity_keys={bad}")
    bad.write_text(text + "va\n")
    with pytest.raises(SiloPflError, match="bad.txt line 6: expected one '<silo> <base64 key>'"):
        job(HEART, "aggregation.secure=true", f"aggregation.identity_keys={bad}")
    # silos.<name>.identity_key unlike the file's line for that silo is refused.
    with pytest.raises(
        SiloPflError, match=r"silos.va.identity_key: not the key aggregation.identity_keys"
    ):
        job(
            HEART, "aggregation.secure=true", f"aggregation.identity_keys={keys_file}",
            "silos.va.identity_key=" + text.splitlines()[1].split()[1],
        )  # fmt: skip


def test_an_update_whose_pairing_is_not_its_silos_signed_one_is_rejected_alone(job):
    """A masked vector comes with the signed set of peers it was masked with; one whose pairing
    was altered is rejected on arrival, as dropped, and the round goes on without it, where the
    bad signature failed the whole round at the unmask request."""
    from plain_federation import aggregate

    secure = ("aggregation.secure=true", "round.min_silos=3")
    silos, server = federation(job, "fedavg", *secure, silos=HOSPITALS)
    # As where the config lists every silo's identity key (else only the silos check them).
    server.protocol.trusted = {s.name: identity.public_bytes(s._identity) for s in silos}
    updates = [update for update, _ in fit_all(silos, server, 1)]
    forged = dataclasses.replace(
        updates[0], pairing=dataclasses.replace(updates[0].pairing, peers=("hungarian",))
    )
    report = aggregate(silos, server, [forged, *updates[1:]])
    assert report.rejected == {
        "cleveland": "update from silo cleveland: its pairing is not signed by its identity key"
    }
    assert report.aggregated and report.accepted == ("hungarian", "switzerland", "va")
