"""Run the secure-aggregation protocol in one process, with silos that drop at a chosen step."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from silo_pfl.secure import identity
from silo_pfl.secure.aggregator import SecureAggregator
from silo_pfl.secure.client import SecureClient
from silo_pfl.secure.messages import Pairing, UnmaskRequest
from silo_pfl.secure.params import SecureParams
from silo_pfl.secure.topology import default_threshold


def federation(
    count: int, neighbors: int | None = None, threshold: int | None = None
) -> tuple[SecureParams, dict[str, SecureClient], SecureAggregator]:
    """`count` silos with fresh identities, each trusting the others' public keys."""
    names = [f"s{i:02d}" for i in range(count)]
    params = SecureParams("fed", tuple(names), threshold or default_threshold(count), neighbors)
    keys = {name: Ed25519PrivateKey.generate() for name in names}
    trusted = {name: identity.public_bytes(key) for name, key in keys.items()}
    clients = {name: SecureClient(params, name, keys[name], trusted) for name in names}
    return params, clients, SecureAggregator(params, trusted)


def run_round(
    clients: Mapping[str, SecureClient],
    server: SecureAggregator,
    payloads: Mapping[str, dict[str, np.ndarray]],
    weights: Mapping[str, int],
    round_: int = 1,
    attempt: int = 1,
    before_sharing: Sequence[str] = (),
    before_masking: Sequence[str] = (),
    after_masking: Sequence[str] = (),
    after_confirming: Sequence[str] = (),
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """One round; silos named in a drop list stop before that step. Returns the unmasked sum
    and every masked vector the server received."""
    adverts = [c.advertise(round_, attempt) for c in clients.values()]
    server.enroll(round_, attempt, adverts)
    sharing = [n for n in clients if n not in before_sharing]
    bundles = [clients[n].share_keys(adverts) for n in sharing]
    inbox = server.route(bundles)
    masking = [n for n in sharing if n not in before_masking]
    vectors = {
        n: clients[n].mask(payloads[n], weights[n], round_, attempt, inbox[n]) for n in masking
    }
    for name in masking:
        server.check(name, round_, attempt)
    asked = server.unmask_request(list(vectors), pairings(clients, list(vectors), round_, attempt))
    request = confirmed(clients, asked, after_masking)
    gone = {*after_masking, *after_confirming}
    reveals = [clients[n].unmask(request) for n in masking if n not in gone]
    return server.unmask(vectors, reveals), vectors


def pairings(
    clients: Mapping[str, SecureClient], survivors: Sequence[str], round_: int = 1, attempt: int = 1
) -> dict[str, Pairing]:
    """The signed pairing each of `survivors` sent with its masked vector."""
    return {name: clients[name].pairing(round_, attempt) for name in survivors}


def unmask_request(
    clients: Mapping[str, SecureClient],
    survivors: Sequence[str],
    dropped: Sequence[str] = (),
    round_: int = 1,
    attempt: int = 1,
) -> UnmaskRequest:
    """An unmask request as a driver may write one, whatever the server would: `survivors` and
    `dropped` as given, with the survivors' signed pairings."""
    alive = tuple(sorted(survivors))
    shown = tuple(pairings(clients, alive, round_, attempt).values())
    return UnmaskRequest(round_, attempt, alive, tuple(sorted(dropped)), pairings=shown)


def confirmed(
    clients: Mapping[str, Any], request: UnmaskRequest, gone: Sequence[str] = ()
) -> UnmaskRequest:
    """The consistency round as the driver runs it: `request` with the signature of each of its
    survivors not in `gone` (`clients`: SecureClients, or Silos, which confirm through theirs)."""
    signers = [n for n in request.survivors if n not in gone]
    signatures = tuple((n, clients[n].confirm(request)) for n in sorted(signers))
    return replace(request, signatures=signatures)
