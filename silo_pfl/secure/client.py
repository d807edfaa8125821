"""A silo's side of secure aggregation: double masking with Shamir-shared secrets.

Per round and attempt: (1) `advertise` two fresh X25519 keys, signed by the silo's identity;
(2) `share_keys`: verify every peer's signed advertisement and the peer set, then seal t-of-n
shares of the self-mask seed and of the mask key to each peer; (3) `mask` the encoded update
with the self mask and a pairwise mask per peer that shared, and sign that set of peers (its
`pairing`); (4) `confirm` the server's unmask request by signing it, once the survivors' signed
pairings show that their masks tie them into one sum (`pairings`), then `unmask`: reveal the
seed shares of survivors and the mask-key shares of those that dropped after step 2, never both
for one silo, and only for the request the silo confirmed and the threshold of survivors signed
(Bonawitz et al.'s consistency round: a coordinator cannot show silos different survivor sets).
Each step runs at most once per round and attempt, in that order.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from silo_pfl.errors import FederationError
from silo_pfl.secure import shamir
from silo_pfl.secure.agreement import KEY_BYTES, mask_key, raw_private, raw_public, seal, unseal
from silo_pfl.secure.fixed_point import encode
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


@dataclass
class _Round:
    """One attempt's secrets and what the silo has done with them."""

    round: int
    attempt: int
    cipher: X25519PrivateKey = field(default_factory=X25519PrivateKey.generate)
    mask: X25519PrivateKey = field(default_factory=X25519PrivateKey.generate)
    seed: bytes = field(default_factory=lambda: secrets.token_bytes(32))
    adverts: dict[str, Advertisement] = field(default_factory=dict)
    roster: bytes = b""  # a digest of `adverts` once checked: what its signatures cover
    topology: Topology | None = None
    held: dict[str, tuple[int, int]] = field(default_factory=dict)  # owner -> its two shares
    paired: tuple[str, ...] = ()  # peers that shared keys: the pairwise masks
    masked: bool = False
    pairing: Pairing | None = None  # `paired`, signed as it masked
    confirmed: UnmaskRequest | None = None  # the one unmask request it signed
    revealed: bool = False


def verify(
    adverts: Sequence[Advertisement],
    params: SecureParams,
    trusted: Mapping[str, bytes],
    round_: int,
    attempt: int,
) -> dict[str, Advertisement]:
    """The round's advertisements by silo, each from a silo of the federation, once, for this
    round and attempt, signed by the identity key the federation lists for it."""
    checked: dict[str, Advertisement] = {}
    for advert in adverts:
        who = f"silo {advert.silo}"
        if advert.silo not in params.silos:
            raise FederationError(f"{who}: not a silo of federation {params.federation}")
        if advert.silo in checked:
            raise FederationError(f"{who}: advertised two key sets in one round")
        if len(advert.cipher_key) != KEY_BYTES or len(advert.mask_key) != KEY_BYTES:
            raise FederationError(
                f"{who}: its round keys are not two {KEY_BYTES}-byte X25519 keys (substituted keys)"
            )
        if (advert.round, advert.attempt) != (round_, attempt):
            raise FederationError(
                f"{who}: its keys are for round {advert.round} attempt {advert.attempt}, not "
                f"round {round_} attempt {attempt} (a replayed advertisement)"
            )
        message = advert.signed_bytes(params.federation)
        if not signed_by(trusted.get(advert.silo), advert.signature, message):
            raise FederationError(
                f"{who}: its round keys are not signed by its identity key (substituted keys)"
            )
        checked[advert.silo] = advert
    return checked


def signed_by(identity: bytes | None, signature: bytes, message: bytes) -> bool:
    """Whether `signature` is of `message` by the Ed25519 public key `identity` (None: none)."""
    if identity is None:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(identity).verify(signature, message)
    except InvalidSignature:
        return False
    return True


def pairing_signed(
    pairing: Pairing, trusted: Mapping[str, bytes], federation: str, attempt_roster: bytes
) -> bool:
    """Whether `pairing` is signed by the identity key `trusted` lists for its silo, over the
    attempt's advertisements (`messages.roster`)."""
    message = pairing.signed_bytes(federation, attempt_roster)
    return signed_by(trusted.get(pairing.silo), pairing.signature, message)


class SecureClient:
    """One silo's party in secure aggregation."""

    def __init__(
        self,
        params: SecureParams,
        silo: str,
        identity: Ed25519PrivateKey,
        trusted: Mapping[str, bytes],
    ) -> None:
        self.params, self.silo, self._identity = params, silo, identity
        self.trusted = dict(trusted)
        self._round: _Round | None = None
        self._last = (0, 0)  # the last round and attempt advertised
        self._revealed: tuple[int, int] | None = None  # the last round and attempt it unmasked

    def _check_request(self, state: _Round, request: UnmaskRequest) -> None:
        """An unmask request this silo may answer: it survived, with at least the threshold of
        enrolled survivors, no silo both survived and dropped, and the survivors' signed
        pairings (its own as it masked) tie them into one sum (`pairings`)."""
        survivors, dropped = set(request.survivors), set(request.dropped)
        if survivors & dropped:
            both = ", ".join(sorted(survivors & dropped))
            raise self._fail(f"asked for both secrets of {both}; it reveals only one")
        if self.silo not in survivors:
            raise self._fail("not among the survivors it is asked to unmask for")
        needed = self.params.threshold
        if len(survivors) < needed:
            raise self._fail(
                f"{len(survivors)} survivors, fewer than aggregation.secure_threshold={needed}"
            )
        unknown = survivors - set(state.adverts)
        if unknown:
            raise self._fail(f"survivor {sorted(unknown)[0]} was not enrolled this round")
        federation = self.params.federation
        try:
            peers = check_pairings(
                request.pairings,
                request.survivors,
                request.dropped,
                state.round,
                state.attempt,
                lambda p: pairing_signed(p, self.trusted, federation, state.roster),
            )
        except PairingError as exc:
            raise self._fail(f"{exc}; it reveals nothing") from None
        if peers[self.silo] != set(state.paired):
            raise self._fail("its pairing in the unmask request is not the one it masked with")

    def _check_signatures(self, request: UnmaskRequest) -> None:
        """At least the threshold of the request's survivors signed exactly this request."""
        state = self._current(request.round, request.attempt)
        message = request.confirmation_bytes(self.params.federation, state.roster)
        signed = {
            silo
            for silo, signature in request.signatures
            if silo in request.survivors and signed_by(self.trusted.get(silo), signature, message)
        }
        needed = self.params.threshold
        if len(signed) < needed:
            raise self._fail(
                f"only {len(signed)} survivors signed the unmask request of round "
                f"{request.round} attempt {request.attempt}, fewer than "
                f"aggregation.secure_threshold={needed}; it reveals nothing (silos lost, or "
                "shown other survivor sets)"
            )

    def _fail(self, message: str) -> FederationError:
        return FederationError(f"silo {self.silo}: {message}")

    def advertise(self, round_: int, attempt: int) -> Advertisement:
        """Step 1: fresh keys for this round's attempt, signed; never twice for one attempt."""
        if (round_, attempt) <= self._last:
            raise self._fail(
                f"asked to advertise round {round_} attempt {attempt}, but it has done round "
                f"{self._last[0]} attempt {self._last[1]} (a replayed round)"
            )
        if self._revealed is not None and self._revealed[0] == round_:
            raise self._fail(
                f"asked to advertise round {round_} attempt {attempt}, but it revealed its "
                f"shares for round {round_} attempt {self._revealed[1]}: a second sum of the "
                "same updates, without some silo, would give that silo's update away"
            )
        self._last = (round_, attempt)
        state = self._round = _Round(round_, attempt)
        advert = Advertisement(
            self.silo, round_, attempt, raw_public(state.cipher), raw_public(state.mask)
        )
        signature = self._identity.sign(advert.signed_bytes(self.params.federation))
        state.adverts = {self.silo: Advertisement(**{**advert.__dict__, "signature": signature})}
        return state.adverts[self.silo]

    def _current(self, round_: int, attempt: int) -> _Round:
        state = self._round
        if state is None or (state.round, state.attempt) != (round_, attempt):
            raise self._fail(f"round {round_} attempt {attempt} was not advertised")
        return state

    def share_keys(self, adverts: Sequence[Advertisement]) -> SealedShares:
        """Step 2: check the round's peers, then seal shares of both secrets to each holder."""
        own = self._round.adverts.get(self.silo) if self._round else None
        if own is None:
            raise self._fail("share_keys before advertise")
        state = self._current(own.round, own.attempt)
        if state.topology is not None:
            raise self._fail(f"refuses to share keys twice in round {state.round}")
        checked = verify(adverts, self.params, self.trusted, state.round, state.attempt)
        if checked.get(self.silo) != own:
            raise self._fail("its own key advertisement is missing or altered")
        needed = self.params.threshold
        if len(checked) < needed:
            raise self._fail(
                f"the round's peer set has {len(checked)} silos ({', '.join(sorted(checked))}), "
                f"fewer than aggregation.secure_threshold={needed}; refusing to share keys"
            )
        plan = topology(
            self.params.silos, list(checked), self.params.graph_seed, needed, self.params.neighbors
        )
        holders = sorted(plan.holders(self.silo))
        if len(holders) < plan.threshold:
            raise self._fail(
                f"only {len(holders) - 1} of its neighbours are in the round "
                f"({', '.join(sorted(plan.peers[self.silo])) or 'none'}), and its secrets need "
                f"{plan.threshold} holders; refusing to share keys"
            )
        state.adverts, state.topology = checked, plan
        state.roster = roster(checked, self.params.federation)
        xs = [self.params.x(h) for h in holders]
        seeds = shamir.split(state.seed, plan.threshold, xs)
        keys = shamir.split(raw_private(state.mask), plan.threshold, xs)
        sealed = {}
        for holder, x in zip(holders, xs, strict=True):
            if holder == self.silo:
                state.held[self.silo] = (seeds[x], keys[x])
                continue
            plaintext = shamir.to_bytes(seeds[x]) + shamir.to_bytes(keys[x])
            sealed[holder] = seal(
                state.cipher,
                checked[holder].cipher_key,
                plaintext,
                self.params.federation,
                state.round,
                state.attempt,
                self.silo,
                holder,
            )
        return SealedShares(self.silo, state.round, state.attempt, sealed)

    def _open(self, state: _Round, inbox: Mapping[str, bytes]) -> None:
        """Unseal the shares the peers sent this silo; each must come from a peer."""
        assert state.topology is not None
        peers = state.topology.peers[self.silo]
        for sender, sealed in sorted(inbox.items()):
            if sender not in peers:
                raise self._fail(f"silo {sender} sent it shares but is not its peer this round")
            plain = unseal(
                state.cipher,
                state.adverts[sender].cipher_key,
                sealed,
                self.params.federation,
                state.round,
                state.attempt,
                sender,
                self.silo,
            )
            if plain is None or len(plain) != 2 * shamir.SHARE_BYTES:
                raise self._fail(f"the shares from silo {sender} were altered or misaddressed")
            half = shamir.SHARE_BYTES
            state.held[sender] = (shamir.from_bytes(plain[:half]), shamir.from_bytes(plain[half:]))
        state.paired = tuple(sorted(inbox))

    def mask(
        self,
        payload: Mapping[str, np.ndarray],
        weight: int,
        round_: int,
        attempt: int,
        inbox: Mapping[str, bytes],
    ) -> np.ndarray:
        """Step 3: the encoded update plus the self mask and the pairwise masks with the peers
        that shared keys (added towards later names, subtracted towards earlier); once."""
        state = self._current(round_, attempt)
        if state.topology is None:
            raise self._fail("mask before share_keys")
        if state.masked:
            raise self._fail(
                f"refuses to mask round {round_} attempt {attempt} twice (a replayed round)"
            )
        self._open(state, inbox)
        if len(state.paired) + 1 < state.topology.threshold:
            raise self._fail(
                f"only {len(state.paired)} peers shared keys; {state.topology.threshold - 1} "
                "are needed to recover its secrets"
            )
        state.masked = True
        pairing = Pairing(self.silo, round_, attempt, state.paired)
        signature = self._identity.sign(pairing.signed_bytes(self.params.federation, state.roster))
        state.pairing = replace(pairing, signature=signature)
        vector = encode(payload, weight, len(self.params.silos), self.silo, self.params.clip)
        keys = [(state.seed, +1)]
        for peer in state.paired:
            key = mask_key(
                state.mask,
                state.adverts[peer].mask_key,
                self.params.federation,
                round_,
                attempt,
                self.silo,
                peer,
            )
            keys.append((key, +1 if self.silo < peer else -1))
        apply_streams(vector, keys)
        return vector

    def pairing(self, round_: int, attempt: int) -> Pairing:
        """The peers it masked with in this attempt, signed: sent with its masked vector."""
        state = self._current(round_, attempt)
        if state.pairing is None:
            raise self._fail(f"round {round_} attempt {attempt} is not masked yet")
        return state.pairing

    def confirm(self, request: UnmaskRequest) -> bytes:
        """The consistency round: this silo's signature of the unmask request it is shown, the
        one request of this attempt it will reveal shares for."""
        state = self._current(request.round, request.attempt)
        if not state.masked:
            raise self._fail(f"asked to confirm round {request.round}'s unmasking before masking")
        if state.confirmed is not None:
            raise self._fail(
                f"refuses to confirm a second unmask request for round {request.round} attempt "
                f"{request.attempt}"
            )
        self._check_request(state, request)
        state.confirmed = replace(request, signatures=())
        message = request.confirmation_bytes(self.params.federation, state.roster)
        return self._identity.sign(message)

    def unmask(self, request: UnmaskRequest) -> Reveal:
        """Step 4: the seed shares of survivors and the mask-key shares of the dropped, for the
        request this silo confirmed, once the threshold of its survivors signed it."""
        state = self._current(request.round, request.attempt)
        if not state.masked:
            raise self._fail(f"asked to unmask round {request.round} before masking")
        if state.revealed:
            raise self._fail(
                f"refuses to unmask round {request.round} attempt {request.attempt} twice"
            )
        if state.confirmed != replace(request, signatures=()):
            raise self._fail(
                f"asked to unmask round {request.round} attempt {request.attempt} for another "
                "survivor set than the one it confirmed"
            )
        self._check_signatures(request)
        survivors, dropped = set(request.survivors), set(request.dropped)
        seeds, keys = {}, {}
        for owner, (seed_share, key_share) in sorted(state.held.items()):
            if owner in survivors:
                seeds[owner] = shamir.to_bytes(seed_share)
            elif owner in dropped:
                keys[owner] = shamir.to_bytes(key_share)
            else:
                raise self._fail(f"silo {owner} is neither a survivor nor dropped in the request")
        state.revealed = True
        self._revealed = (request.round, request.attempt)
        return Reveal(self.silo, request.round, request.attempt, seeds, keys)
