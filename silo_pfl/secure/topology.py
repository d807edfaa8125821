"""Who pairs with whom in one round, and how many shares recover a secret.

Full mesh: every enrolled silo pairs with every other, and a secret is recovered from
aggregation.secure_threshold shares. SecAgg+ (aggregation.secure_graph.neighbors=k): each
silo pairs only with its k neighbours on a Harary graph H(k, N) over all N silos of the
federation, whose vertex order is a hash of the federation's name and silos (`graph_seed`): one
graph for the whole run, which no coordinator can draw again by relaying some silos' keys and not
others', or by failing attempts. A silo's peers in a round are its neighbours enrolled in it. A
secret is shared among the silo and those peers, and recovered from a proportional share of the
k + 1 holders it would have with every neighbour (always a majority, so that no one can obtain
both of a silo's secrets, however many neighbours a coordinator says dropped).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass


def default_threshold(silos: int) -> int:
    """ceil(2N/3): a majority that tolerates a third of the silos dropping."""
    return math.ceil(2 * silos / 3)


def degree(silos: int, k: int) -> int:
    """Each silo's peers on the Harary graph H(k, n) of `silos` silos: k, raised by one if k and
    n are both odd (no k-regular graph exists then), and at most n - 1 (a full mesh)."""
    if k >= silos - 1:
        return silos - 1
    return k + 1 if k % 2 and silos % 2 else k


def share_threshold(holders: int, threshold: int, federation_size: int) -> int:
    """Shares that recover a secret held by `holders` (a silo and its peers): their share of
    aggregation.secure_threshold, and always a majority of them."""
    return min(max(holders // 2 + 1, math.ceil(holders * threshold / federation_size)), holders)


def harary(order: Sequence[str], k: int) -> dict[str, frozenset[str]]:
    """The k-regular Harary graph on `order` (a ring, each joined to its k/2 nearest on either
    side, and across for an odd k); k as `degree` makes it."""
    n = len(order)
    k = degree(n, k)
    if k >= n - 1:
        return {a: frozenset(order) - {a} for a in order}
    edges: dict[str, set[str]] = {a: set() for a in order}
    for i, a in enumerate(order):
        for step in range(1, k // 2 + 1):
            b = order[(i + step) % n]
            edges[a].add(b)
            edges[b].add(a)
        if k % 2:
            b = order[(i + n // 2) % n]
            edges[a].add(b)
            edges[b].add(a)
    return {a: frozenset(b) for a, b in edges.items()}


@dataclass(frozen=True)
class Topology:
    """One round's pairing: each enrolled silo's peers and the share threshold of its secrets."""

    enrolled: tuple[str, ...]
    peers: dict[str, frozenset[str]]
    threshold: int  # shares that recover one silo's secret
    survivors: int  # silos needed at every step (aggregation.secure_threshold)

    def holders(self, silo: str) -> frozenset[str]:
        """Who holds a share of `silo`'s secrets: itself and its peers."""
        return self.peers[silo] | {silo}


def graph_seed(federation: str, silos: Sequence[str]) -> bytes:
    """What orders SecAgg+'s graph: the federation's name and its silos, fixed before any key."""
    text = "|".join(["silo_pfl secagg+ graph", federation, *sorted(silos)])
    return hashlib.sha256(text.encode()).digest()


def topology(
    silos: Sequence[str],
    enrolled: Sequence[str],
    seed: bytes,
    threshold: int,
    neighbors: int | None,
) -> Topology:
    """The round's topology over `enrolled`, of the federation's `silos`; `seed` (`graph_seed`)
    orders SecAgg+'s graph over all of them."""
    names = tuple(sorted(enrolled))
    everyone = tuple(sorted(silos))
    if neighbors is None or neighbors >= len(everyone) - 1:
        peers = {a: frozenset(names) - {a} for a in names}
        return Topology(names, peers, threshold, threshold)
    order = sorted(everyone, key=lambda a: hashlib.sha256(seed + a.encode()).digest())
    graph = harary(order, neighbors)
    here = frozenset(names)
    peers = {a: graph[a] & here for a in names}
    holders = degree(len(everyone), neighbors) + 1
    return Topology(names, peers, share_threshold(holders, threshold, len(everyone)), threshold)
