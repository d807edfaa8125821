"""Placement by Ray node label: which label each actor needs, checked against the live nodes."""

from __future__ import annotations

import time

import pytest

from silo_pfl.errors import FederationError
from silo_pfl.runtime.placement import (
    HEAD_RESOURCE,
    actor_options,
    check_labels,
    server_selector,
    silo_selector,
)

JOB = "jobs/heart_disease.yaml"


def test_per_node_pins_each_silo_to_its_label_unless_it_names_its_own(job):
    cfg = job(JOB, "ray.placement=per_node", "silos.va.node_label.site=long-beach")
    assert silo_selector(cfg, "cleveland") == {"silo": "cleveland"}
    assert silo_selector(cfg, "va") == {"site": "long-beach"}
    assert server_selector(cfg) is None
    assert actor_options(server_selector(cfg), on_head=True) == {
        "resources": {HEAD_RESOURCE: 0.001}
    }
    assert actor_options(silo_selector(cfg, "va")) == {"label_selector": {"site": "long-beach"}}


def test_placement_any_leaves_silos_free_but_honours_explicit_labels(job):
    cfg = job(JOB, "silos.va.node_label.silo=va", "server.node_label.zone=dmz")
    assert silo_selector(cfg, "cleveland") is None
    assert actor_options(silo_selector(cfg, "cleveland")) == {}
    assert silo_selector(cfg, "va") == {"silo": "va"}
    assert actor_options(server_selector(cfg), on_head=False) == {"label_selector": {"zone": "dmz"}}


def test_a_label_no_live_node_carries_is_one_line_naming_the_actor(ray_local):
    node = ray_local.get_runtime_context().get_node_id()
    check_labels({"silo a": {"ray.io/node-id": node}, "silo b": None}, wait=1)
    began = time.monotonic()
    with pytest.raises(FederationError) as info:
        check_labels({"silo a": {"ray.io/node-id": node}, "silo b": {"silo": "b"}}, wait=1)
    assert time.monotonic() - began < 5
    message = str(info.value)
    assert message.startswith("silo b: no live Ray node carries the label silo=b")
    assert "ray start --labels=silo=b" in message and "\n" not in message
