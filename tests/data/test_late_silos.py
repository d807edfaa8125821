"""data.late_silos and data.max_train_rows, options of every data source."""

from __future__ import annotations

import numpy as np
import pytest

from silo_pfl.data import all_silo_names, load_silo_data, silo_names
from silo_pfl.errors import ConfigError
from silo_pfl.settings import load_config

SKEW = "jobs/digits_label_skew.yaml"
HEART = "jobs/heart_disease.yaml"


def _cfg(job, path: str, *overrides: str):
    return job(path, "tracking.enabled=false", *overrides)


@pytest.mark.parametrize(
    ("path", "late"), [(SKEW, ["silo_3", "silo_9"]), (HEART, ["va"])], ids=["digits", "heart"]
)
def test_late_silos_sit_out_but_keep_their_share(job, path, late):
    plain = _cfg(job, path)
    held = _cfg(job, path, f"data.late_silos=[{','.join(late)}]")
    assert silo_names(held.data) == [s for s in silo_names(plain.data) if s not in late]
    assert all_silo_names(held.data) == silo_names(plain.data)
    for silo in late:
        alone, among = load_silo_data(held.data, silo, 0), load_silo_data(plain.data, silo, 0)
        assert np.array_equal(alone.x_train, among.x_train)
        assert np.array_equal(alone.y_test, among.y_test)


def test_a_late_silo_may_have_its_own_section(job):
    cfg = _cfg(job, HEART, "data.late_silos=[va]", "silos.va.node_label={silo: va}")
    assert cfg.silos["va"].node_label == {"silo": "va"}


def test_max_train_rows_caps_training_rows_only_and_is_seeded(job):
    full = _cfg(job, SKEW)
    capped = _cfg(job, SKEW, "data.max_train_rows=50")
    a, b = load_silo_data(full.data, "silo_2", 0), load_silo_data(capped.data, "silo_2", 0)
    assert len(a.y_train) > 50 and len(b.y_train) == 50
    assert b.num_train_total == 50 + len(b.y_val)
    assert np.array_equal(a.x_val, b.x_val) and np.array_equal(a.x_test, b.x_test)
    rows = {row.tobytes() for row in a.x_train}
    assert all(row.tobytes() in rows for row in b.x_train)
    again = load_silo_data(capped.data, "silo_2", 0)
    assert np.array_equal(again.x_train, b.x_train)
    other = load_silo_data(capped.data, "silo_2", 1)
    assert not np.array_equal(other.x_train, b.x_train)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("data.late_silos=[silo_12]", "data.late_silos: 'silo_12' is not a silo of"),
        ("data.late_silos=[silo_1,silo_1]", "data.late_silos: got ['silo_1', 'silo_1']"),
        ("data.max_train_rows=0", "data.max_train_rows: got 0, expected >= 1"),
    ],
)
def test_bad_options_name_the_key(override, message):
    with pytest.raises(ConfigError) as error:
        load_config(SKEW, [override])
    assert str(error.value).startswith(message)
    assert "\n" not in str(error.value)


def test_every_silo_late_is_an_error():
    with pytest.raises(ConfigError, match="^data.late_silos: names every silo"):
        load_config(HEART, ["data.late_silos=[cleveland,hungarian,switzerland,va]"])
