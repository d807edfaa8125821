"""Where each actor may run: Ray node labels, checked against the live nodes before any start.

Under `ray.placement=per_node` silo X needs a node labelled `silo=X` and the server the head
node; `silos.<name>.node_label` and `server.node_label` choose other labels. A label that no
live node carries is an error naming the actor and the label, never a hang.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import ray

from silo_pfl.config import FederationConfig, describe_labels, silo_selector
from silo_pfl.errors import FederationError
from silo_pfl.runtime.metrics import ray_address

HEAD_RESOURCE = "node:__internal_head__"  # offered by the head node only
# A node may still be joining when the run starts: wait this long for a label before failing.
LABEL_WAIT_SECONDS = 5.0


def server_selector(cfg: FederationConfig) -> dict[str, str] | None:
    """The labels the server's node must carry (None: the head under per_node, else any)."""
    return dict(cfg.server.node_label) if cfg.server.node_label else None


def actor_options(selector: Mapping[str, str] | None, on_head: bool = False) -> dict[str, Any]:
    """Ray actor options that pin an actor to nodes with `selector`, or to the head node."""
    if selector:
        return {"label_selector": dict(selector)}
    if on_head:
        return {"resources": {HEAD_RESOURCE: 0.001}}
    return {}


def _carries(node: Mapping[str, Any], selector: Mapping[str, str]) -> bool:
    labels = node.get("Labels") or {}
    return all(labels.get(k) == v for k, v in selector.items())


def check_labels(selectors: Mapping[str, Mapping[str, str] | None], wait: float) -> None:
    """Every role ("silo va", "the server") with a selector has a live node carrying it.

    Polls for up to `wait` seconds (nodes that are still joining), then raises a one-line
    FederationError naming the first role whose label no node carries.
    """
    deadline = time.monotonic() + wait
    while True:
        pending = homeless(selectors)
        if not pending or time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    if pending:
        role = next(iter(pending))
        selector = selectors[role] or {}
        raise FederationError(
            f"{role}: no live Ray node carries the label {describe_labels(selector)} (waited "
            f"{wait:.0f} s); start its node with `ray start --labels={describe_labels(selector)}` "
            "or change the label"
        )


def homeless(selectors: Mapping[str, Mapping[str, str] | None]) -> dict[str, str]:
    """The roles whose selector no live node carries now, each with why: a silo whose labelled
    node died cannot be restarted by Ray until such a node joins."""
    pending = {role: sel for role, sel in selectors.items() if sel}
    if not pending:
        return {}
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    return {
        role: f"no live Ray node carries its label {describe_labels(sel)}"
        for role, sel in pending.items()
        if not any(_carries(n, sel) for n in nodes)
    }


def check_own_nodes(cfg: FederationConfig, nodes: Mapping[str, str]) -> None:
    """Under ray.placement=per_node every silo ran on a node of its own (`nodes`: silo -> the
    node its set-up ran on). Two silos whose labels one node carries would both read that
    node's data; a one-line FederationError names them, before anything trains."""
    if cfg.ray.placement != "per_node":
        return
    first: dict[str, str] = {}
    for silo, node in nodes.items():
        if node in first:
            raise FederationError(
                f"silos {first[node]} and {silo}: both run on node {node[:12]}, whose labels "
                f"match {describe_labels(silo_selector(cfg, first[node]) or {})} and "
                f"{describe_labels(silo_selector(cfg, silo) or {})}; under ray.placement=per_node "
                "each silo needs a node of its own, so give each silo a label only its node carries"
            )
        first[node] = silo


def check_local_cpus(cfg: FederationConfig, groups: Sequence[Sequence[str]], cpus: float) -> None:
    """The CPUs the silos' workers reserve (ray.silo_cpus per silo; `groups`: the silos of each
    worker) can be had, else a one-line FederationError naming ray.silo_cpus rather than a wait
    until the set-up call times out. On a local Ray (`ray.address` and RAY_ADDRESS unset;
    nothing joins it) they together fit in its `cpus`; on a cluster each pinned worker fits on
    one of the nodes it may run on (`check_node_cpus`)."""
    if ray_address(cfg.ray.address) is not None:
        check_node_cpus(cfg, groups)
        return
    silos = sum(len(names) for names in groups)
    need = cfg.ray.silo_cpus * silos
    if need > cpus:
        raise FederationError(
            f"ray.silo_cpus: got {cfg.ray.silo_cpus:g}, which reserves {need:g} CPUs for "
            f"{silos} silos, but the local Ray has {cpus:g}; expected at most "
            f"{cpus / silos:g}, or 0 to let silos share cores"
        )


def check_node_cpus(cfg: FederationConfig, groups: Sequence[Sequence[str]]) -> None:
    """On a cluster: each worker pinned by a label (per_node's silo=<name>, or
    silos.<name>.node_label) reserves ray.silo_cpus per silo it hosts; if no live node carrying
    its label has that many CPUs, or those nodes have fewer in all than every worker pinned to
    the label reserves (two silos given one node_label; an onboarding's silo and its alone
    baseline), Ray could never start them all, so this fails at once naming ray.silo_cpus, the
    silos and those nodes' CPUs. A label no live node carries is check_labels' to report. An
    unpinned worker is not checked: it may run on any node, and a cluster may grow (an
    autoscaler adds nodes for a request no node meets yet), whereas a labelled node's CPUs are
    fixed when it starts."""
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    pinned: dict[str, tuple[dict[str, str], list[Sequence[str]]]] = {}
    for names in groups:
        selector = silo_selector(cfg, names[0]) if names else None
        if selector:
            pinned.setdefault(describe_labels(selector), (selector, []))[1].append(names)
    for labels, (selector, workers) in pinned.items():
        sizes = sorted(
            float(n.get("Resources", {}).get("CPU", 0)) for n in nodes if _carries(n, selector)
        )
        silos = [name for names in workers for name in names]
        widest = max(len(names) for names in workers)
        if not sizes or (
            sizes[-1] >= cfg.ray.silo_cpus * widest and sum(sizes) >= cfg.ray.silo_cpus * len(silos)
        ):
            continue
        distinct = list(dict.fromkeys(silos))  # an onboarding's silo and its alone baseline
        named = ", ".join(distinct)
        if len(workers) > 1:
            of = f"silo {named}" if len(distinct) == 1 else f"silos {named}"
            who = f"the {len(workers)} workers of {of} together reserve"
            room = f"more than the live nodes labelled {labels} have in all"
            most = min(sizes[-1] / widest, sum(sizes) / len(silos))
        else:
            who = (
                f"silo {named} reserves"
                if len(silos) == 1
                else f"the worker of silos {named} reserves"
            )
            room, most = f"more than any live node labelled {labels} has", sizes[-1] / widest
        cpus = ", ".join(f"{c:g}" for c in sizes)
        raise FederationError(
            f"ray.silo_cpus: got {cfg.ray.silo_cpus:g}, so {who} "
            f"{cfg.ray.silo_cpus * len(silos):g} CPUs, {room} (CPUs: {cpus}); expected at most "
            f"{most:g}, or 0 to let silos share cores"
        )
