"""The server's side of secure aggregation: it fixes each step's set of silos, routes the
sealed shares, checks every masked vector, and removes the masks from their sum with the
revealed shares. It learns the sum of the survivors' encoded updates and nothing else."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from silo_pfl.errors import FederationError
from silo_pfl.secure import shamir
from silo_pfl.secure.agreement import mask_key
from silo_pfl.secure.client import pairing_signed, verify
from silo_pfl.secure.messages import (
    Advertisement,
    Pairing,
    Reveal,
    SealedShares,
    UnmaskRequest,
    roster,
)
from silo_pfl.secure.pairings import PairingError, check_pairings
from silo_pfl.secure.params import SecureParams
from silo_pfl.secure.prg import apply_streams
from silo_pfl.secure.topology import Topology, topology
from silo_pfl.slices import CORES


class SecureRoundError(FederationError):
    """A round of secure aggregation cannot complete: too few silos, or shares, remain."""


class SecureAggregator:
    """One round's protocol state on the server; `enroll` starts each attempt afresh."""

    def __init__(self, params: SecureParams, trusted: Mapping[str, bytes] | None = None) -> None:
        self.params = params
        self.trusted = dict(trusted) if trusted is not None else None
        self.round, self.attempt = 0, 0
        self.adverts: dict[str, Advertisement] = {}
        self.roster = b""  # a digest of `adverts`: what the silos' pairings are signed over
        self.topology: Topology | None = None
        self.shared: tuple[str, ...] = ()  # U2: the silos whose shares went out
        self.request: UnmaskRequest | None = None
        self.paired: dict[str, frozenset[str]] = {}  # each survivor's peers, as it signed them

    def _enough(self, step: str, names: Sequence[str]) -> None:
        needed = self.params.threshold
        if len(names) < needed:
            missing = sorted(set(self.params.silos) - set(names))
            raise SecureRoundError(
                f"round {self.round}: secure aggregation has {len(names)} silos at {step}, "
                f"fewer than aggregation.secure_threshold={needed} (missing "
                f"{', '.join(missing)}); nothing is aggregated"
            )

    def enroll(self, round_: int, attempt: int, adverts: Sequence[Advertisement]) -> None:
        """Step 1: the round's enrolled silos are those whose signed keys arrived."""
        self.round, self.attempt = round_, attempt
        self.shared, self.request, self.topology, self.paired = (), None, None, {}
        if self.trusted is not None:
            self.adverts = verify(adverts, self.params, self.trusted, round_, attempt)
        else:
            self.adverts = {a.silo: a for a in adverts}
        self._enough("key advertisement", list(self.adverts))
        self.roster = roster(self.adverts, self.params.federation)
        self.topology = topology(
            self.params.silos,
            list(self.adverts),
            self.params.graph_seed,
            self.params.threshold,
            self.params.neighbors,
        )

    def route(self, bundles: Sequence[SealedShares]) -> dict[str, dict[str, bytes]]:
        """Step 2: each enrolled silo's sealed shares go to their holders; the silos that sent
        them are the round's set for masking, fixed here."""
        plan = self.topology
        if plan is None:
            raise SecureRoundError(f"round {self.round}: shares before enrolment")
        senders: list[str] = []
        for bundle in sorted(bundles, key=lambda b: b.silo):
            if bundle.silo not in self.adverts or bundle.silo in senders:
                raise SecureRoundError(f"silo {bundle.silo}: shares not expected from it")
            if (bundle.round, bundle.attempt) != (self.round, self.attempt):
                raise SecureRoundError(f"silo {bundle.silo}: shares for another round")
            if set(bundle.sealed) != plan.peers[bundle.silo]:
                raise SecureRoundError(f"silo {bundle.silo}: shares not sealed to its peers")
            senders.append(bundle.silo)
        self._enough("key sharing", senders)
        self.shared = tuple(senders)
        inbox: dict[str, dict[str, bytes]] = {name: {} for name in senders}
        for bundle in bundles:
            for holder, sealed in bundle.sealed.items():
                if holder in inbox:
                    inbox[holder][bundle.silo] = sealed
        return inbox

    def check(self, silo: str, round_: int, attempt: int) -> None:
        """Step 3: a masked vector must come from a silo that shared keys, for this attempt."""
        if silo not in self.shared:
            raise ValueError(
                f"update from silo {silo}: not among the silos that shared keys in round "
                f"{self.round} attempt {self.attempt}"
            )
        if (round_, attempt) != (self.round, self.attempt):
            raise ValueError(
                f"update from silo {silo}: masked for round {round_} attempt {attempt}, not "
                f"round {self.round} attempt {self.attempt}"
            )

    def unmask_request(
        self, survivors: Sequence[str], pairings: Mapping[str, Pairing]
    ) -> UnmaskRequest:
        """Step 4's question: the silos whose masked vectors were accepted, with their signed
        pairings, and the dropped; a SecureRoundError where those pairings do not tie the
        survivors into one sum (`pairings.check_pairings`: the silos would refuse it)."""
        self._enough("masked input", list(survivors))
        alive = tuple(sorted(survivors))
        dropped = tuple(sorted(set(self.shared) - set(survivors)))
        shown = tuple(pairings[name] for name in alive if name in pairings)
        try:
            self.paired = check_pairings(
                shown, alive, dropped, self.round, self.attempt, self.signed
            )
        except PairingError as exc:
            raise SecureRoundError(f"round {self.round}: {exc}; nothing is aggregated") from None
        self._check_recoverable(alive, dropped)
        self.request = UnmaskRequest(self.round, self.attempt, alive, dropped, pairings=shown)
        return self.request

    def _check_recoverable(self, alive: Sequence[str], dropped: Sequence[str]) -> None:
        """Before any silo reveals a share (after which none takes part in a retry of the
        round): each survivor's seed, and the mask key of each dropped silo a survivor masked
        with, has shares enough among the survivors, its holders being the silos that paired
        with it (and a survivor itself). Else the round fails here, to be tried again afresh."""
        assert self.topology is not None
        needed = self.topology.threshold
        holders = {
            owner: sum(owner in self.paired[p] for p in alive) + (owner in self.paired)
            for owner in (*alive, *dropped)
        }
        secrets = [(s, "self-mask seed") for s in alive] + [
            (d, "mask key") for d in dropped if holders[d] > 0
        ]
        for owner, what in secrets:
            if holders[owner] < needed:
                raise SecureRoundError(
                    f"round {self.round}: {holders[owner]} survivors hold shares of silo "
                    f"{owner}'s {what}, {needed} needed; nothing is revealed or aggregated"
                )

    def signed(self, pairing: Pairing) -> bool:
        """Whether `pairing` is signed by its silo's identity (unchecked where the server holds
        no identity keys: every silo checks it)."""
        if self.trusted is None:
            return True
        return pairing_signed(pairing, self.trusted, self.params.federation, self.roster)

    def _recover(self, reveals: Sequence[Reveal]) -> tuple[dict[str, bytes], dict[str, bytes]]:
        """Each survivor's seed and each dropped silo's mask key, from the revealed shares."""
        request, plan = self.request, self.topology
        assert request is not None and plan is not None
        seeds: dict[str, dict[int, int]] = {name: {} for name in request.survivors}
        paired_with = {name for peers in self.paired.values() for name in peers}
        keys: dict[str, dict[int, int]] = {n: {} for n in request.dropped if n in paired_with}
        seen: set[str] = set()
        for reveal in reveals:
            if reveal.silo not in request.survivors or reveal.silo in seen:
                raise SecureRoundError(f"silo {reveal.silo}: a reveal not expected from it")
            if (reveal.round, reveal.attempt) != (self.round, self.attempt):
                raise SecureRoundError(f"silo {reveal.silo}: a reveal for another round")
            seen.add(reveal.silo)
            x = self.params.x(reveal.silo)
            for into, shares in ((seeds, reveal.seeds), (keys, reveal.mask_keys)):
                for owner, share in shares.items():
                    if owner in into and reveal.silo in plan.holders(owner):
                        into[owner][x] = shamir.from_bytes(share)
        recovered: list[dict[str, bytes]] = [{}, {}]
        for out, shares, what in ((0, seeds, "self-mask seed"), (1, keys, "mask key")):
            for owner, points in shares.items():
                if len(points) < plan.threshold:
                    raise SecureRoundError(
                        f"round {self.round}: {len(points)} shares of silo {owner}'s {what} "
                        f"arrived, {plan.threshold} needed; nothing is aggregated"
                    )
                recovered[out][owner] = shamir.combine(points, plan.threshold)
        return recovered[0], recovered[1]

    def unmask(self, vectors: Mapping[str, np.ndarray], reveals: Sequence[Reveal]) -> np.ndarray:
        """Step 4: the survivors' sum with every mask removed."""
        request, plan = self.request, self.topology
        if request is None or plan is None or set(vectors) != set(request.survivors):
            raise SecureRoundError(f"round {self.round}: unmask without its request")
        seeds, keys_of_dropped = self._recover(reveals)
        first, *others = (vectors[name] for name in request.survivors)
        total = first.copy()
        keys = [(seed, -1) for seed in seeds.values()]
        survivors = set(request.survivors)
        for gone, raw in keys_of_dropped.items():
            private = X25519PrivateKey.from_private_bytes(raw)
            for peer in sorted(p for p in survivors if gone in self.paired[p]):
                key = mask_key(
                    private,
                    self.adverts[peer].mask_key,
                    self.params.federation,
                    self.round,
                    self.attempt,
                    gone,
                    peer,
                )
                keys.append((key, -1 if peer < gone else +1))
        apply_streams(total, keys, plus=others, threads=CORES)  # the silos wait, idle
        return total
