"""A silo's node fills in `$NAME`s from its own environment, and names only a variable the
value it was given names and the node does not set."""

from __future__ import annotations

import pytest

from silo_pfl.errors import ConfigError
from silo_pfl.node_env import expand
from silo_pfl.tracking.uri import node_uri

STORE = "postgresql://admin:Zq$ecret99@db.hospital.lan/mlflow"


def test_a_dollar_inside_a_variables_value_is_kept_not_taken_for_a_variable(monkeypatch):
    """The expanded text was searched again: a password holding `$ecret99` was reported as an
    unset variable `ecret99`, a part of the password printed in the error."""
    monkeypatch.setenv("SILO_STORE", STORE)
    monkeypatch.setenv("SILO_PATH", "/data/$USER/heart.csv")
    assert expand("$SILO_STORE") == (STORE, None)
    assert expand("${SILO_PATH}") == ("/data/$USER/heart.csv", None)
    assert node_uri("$SILO_STORE", "silos.va.tracking_uri", "va") == STORE


def test_a_variable_the_node_does_not_set_is_named(monkeypatch):
    monkeypatch.delenv("NOT_ON_THIS_NODE", raising=False)
    monkeypatch.setenv("SILO_HOST", "db")
    assert expand("postgresql://$SILO_HOST/${NOT_ON_THIS_NODE}") == (
        "postgresql://db/${NOT_ON_THIS_NODE}",
        "NOT_ON_THIS_NODE",
    )
    with pytest.raises(ConfigError, match=r"^silos.va.tracking_uri: environment variable "):
        node_uri("$NOT_ON_THIS_NODE", "silos.va.tracking_uri", "va")
