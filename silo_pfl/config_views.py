"""What each party is given of the config, and what is logged of it: the one place that hides
other silos' settings and every secret.

- An actor (a silo worker, or the server) gets the shared sections, its own silos' `silos.<name>`
  sections and data paths; of every other silo only its name, its public identity key and its
  node labels (where Ray places it: not secret, and the placement checks every actor repeats
  compare all silos' labels).
- What is logged (MLflow params, `federation.json`) has every store URI's password and secret
  query values masked as `***`, and `data.paths` only as the names of the silos that have one.
"""

from __future__ import annotations

import copy
from collections.abc import Collection
from typing import Any

from silo_pfl.tracking.uri import redact

HIDDEN = "***"


def actor_view(config: dict[str, Any], silos: Collection[str]) -> dict[str, Any]:
    """The config (as `config.to_dict` made it) as an actor holding `silos` receives it."""
    view = copy.deepcopy(config)
    view["silos"] = {
        name: section if name in silos else _public(section)
        for name, section in config.get("silos", {}).items()
    }
    paths = view.get("data", {}).get("paths")
    if paths:
        view["data"]["paths"] = {n: p if n in silos else HIDDEN for n, p in paths.items()}
    return view


def _public(section: dict[str, Any]) -> dict[str, Any]:
    """Of another silo's settings, only its public identity key (to verify its signatures) and
    its node labels (so that an actor's checks see the placement the driver's saw)."""
    return {k: section[k] for k in ("identity_key", "node_label") if section.get(k)}


def logged_view(config: dict[str, Any]) -> dict[str, Any]:
    """The config as it may be logged: store URIs redacted, data paths hidden."""
    view = copy.deepcopy(config)
    tracking = view.get("tracking", {})
    if tracking.get("uri"):
        tracking["uri"] = redact(str(tracking["uri"]))
    for section in view.get("silos", {}).values():
        if section.get("tracking_uri"):
            section["tracking_uri"] = redact(str(section["tracking_uri"]))
    paths = view.get("data", {}).get("paths")
    if paths:
        view["data"]["paths"] = dict.fromkeys(paths, HIDDEN)
    return view
