"""What every survivor's signed pairing must show before a silo reveals shares, or the server
asks for them: the survivors' masks tie them into one sum.

A survivor's masked vector carries a pairwise mask towards each peer it paired with. The server
rebuilds every survivor's self mask, and the mask keys of those that dropped, so the masks it
cannot remove are those between two survivors. Where the survivors split into parts with no
such pair between them (peers that genuinely dropped, silos left out of a SecAgg+ round, or a
coordinator withholding the shares across a cut), each part's masks cancel within it, and the
part's sum (one silo's update, for a part of one) would be unmasked on its own. So each
survivor signs the peers it paired with as it masks (`messages.Pairing`), and every silo checks
all of them: signed, for this attempt, both ways between survivors, only with silos that
survived or dropped, and connecting every survivor.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from silo_pfl.errors import FederationError
from silo_pfl.secure.messages import Pairing


class PairingError(FederationError):
    """The survivors' pairings do not tie them into one sum; says why, without a subject."""


def check_pairings(
    pairings: Sequence[Pairing],
    survivors: Sequence[str],
    dropped: Sequence[str],
    round_: int,
    attempt: int,
    signed: Callable[[Pairing], bool],
) -> dict[str, frozenset[str]]:
    """Each survivor's peers, from its one pairing for (`round_`, `attempt`) that `signed`
    accepts; raises PairingError where a survivor's is missing, a pair of survivors paired one
    way only, a peer neither survived nor dropped, or the survivors are not one connected
    whole."""
    alive, shared = set(survivors), set(survivors) | set(dropped)
    peers: dict[str, frozenset[str]] = {}
    for pairing in pairings:
        if pairing.silo not in alive or pairing.silo in peers:
            raise PairingError(f"a pairing of silo {pairing.silo} not expected in the request")
        if (pairing.round, pairing.attempt) != (round_, attempt) or not signed(pairing):
            raise PairingError(
                f"the pairing of survivor {pairing.silo} is not its signed one of round "
                f"{round_} attempt {attempt}"
            )
        peers[pairing.silo] = frozenset(pairing.peers)
    missing = sorted(alive - set(peers))
    if missing:
        raise PairingError(f"no signed pairing of survivor {missing[0]}")
    for silo in sorted(peers):
        stray = sorted(peers[silo] - shared)
        if stray:
            raise PairingError(
                f"survivor {silo} paired with silo {stray[0]}, which neither survived nor dropped"
            )
        one_way = sorted(p for p in peers[silo] & alive if silo not in peers[p])
        if one_way:
            raise PairingError(f"survivor {silo} paired with {one_way[0]}, but not back")
    first = min(alive)
    reached, frontier = {first}, [first]
    while frontier:
        for peer in peers[frontier.pop()] & alive - reached:
            reached.add(peer)
            frontier.append(peer)
    if reached != alive:
        apart = sorted(alive - reached)
        raise PairingError(
            f"the survivors' masks split them into parts ({', '.join(apart)} apart from "
            f"{first}'s {len(reached)}): a part's sum would be unmasked on its own"
        )
    return peers
