"""A registered model of a plugin's algorithm loads where the plugin is importable: the pyfunc
records the run's `plugins` and imports them before it rebuilds the algorithm; where a plugin
cannot be imported, loading fails in one line naming it. Each load runs in a fresh process, so
the plugin is not already imported there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlflow.models
import mlflow.pyfunc
import numpy as np
import pandas as pd
import pytest
from serving import registered_silo

from silo_pfl.tracking import exporter, pyfunc

REPO = Path(__file__).resolve().parents[1]
PLUGIN = "tests.fault_plugins"  # as tests/test_faults.py names it: importable from the repo root
MODEL = "models:/heart_disease-hungarian@champion"
# Loads MODEL in a fresh process and prints its predictions on the rows read from stdin as JSON,
# or the error's type and its message's first line.
LOAD = f"""
import json, sys
import pandas as pd
import mlflow.pyfunc
assert not [m for m in sys.modules if m.endswith("fault_plugins")], "the plugin is imported"
frame = pd.DataFrame(**json.load(sys.stdin))
try:
    model = mlflow.pyfunc.load_model({MODEL!r})
except Exception as exc:
    print("error", type(exc).__name__, str(exc).splitlines()[0])
else:
    print("predictions", json.dumps(model.predict(frame).tolist()))
"""


@pytest.fixture(scope="module")
def plugin_silo(tmp_path_factory):
    """One hospital trained with the plugin's algorithm (`nan_once`, which strikes no silo
    unless told to: plain FedPer), its model registered in a SQLite store; and the store."""
    tmp = tmp_path_factory.mktemp("plugin_silo")
    store = f"sqlite:///{tmp / 'mlflow.db'}"
    plugin = (f"plugins=[{PLUGIN}]", "algorithm.name=nan_once")
    silo = registered_silo(tmp, store, "hungarian", "jobs/heart_disease.yaml", *plugin)
    return silo, store


def _load_elsewhere(store: str, rows: pd.DataFrame, cwd: Path) -> str:
    """The last line of LOAD, run by a fresh Python in `cwd` against `store`."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["MLFLOW_TRACKING_URI"] = store
    done = subprocess.run(
        [sys.executable, "-c", LOAD],
        input=json.dumps(rows.to_dict(orient="split", index=False)),
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def _test_rows(silo) -> pd.DataFrame:
    return pd.DataFrame(silo.data.x_test_raw, columns=list(silo.data.raw_columns))


def test_a_plugin_algorithms_model_loads_and_predicts_in_a_fresh_process(plugin_silo, monkeypatch):
    silo, store = plugin_silo
    line = _load_elsewhere(store, _test_rows(silo), REPO)  # the repo root: the plugin imports
    kind, _, answer = line.partition(" ")
    assert kind == "predictions", line
    predictions = np.asarray(json.loads(answer))
    assert predictions.shape == silo.data.y_test.shape
    accuracy = float(np.mean(predictions == silo.data.y_test))
    assert accuracy == pytest.approx(silo.outcome().test_accuracy)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    assert mlflow.models.get_model_info(MODEL).metadata["plugins"] == [PLUGIN]  # for operators


def test_a_plugin_that_cannot_be_imported_where_the_model_loads_is_one_line_naming_it(
    plugin_silo, tmp_path
):
    silo, store = plugin_silo
    line = _load_elsewhere(store, _test_rows(silo), tmp_path)  # the plugin is not importable
    assert line.startswith("error ConfigError plugins: "), line
    assert repr(PLUGIN) in line
    assert "must be importable where the model is loaded or served" in line
    assert "ModuleNotFoundError" in line


def test_a_model_logged_before_plugins_were_recorded_still_loads(plugin_silo, tmp_path):
    """Such a model's pickled SiloPyfunc has no `plugins`: it loads as before (here, with the
    plugin imported by the training in this process)."""
    silo, _ = plugin_silo
    made = pyfunc.SiloPyfunc.__init__

    def as_before(self, *args, **kwargs) -> None:
        made(self, *args, **kwargs)
        self.__dict__.pop("plugins", None)

    path = tmp_path / "old_model"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pyfunc.SiloPyfunc, "__init__", as_before)
        exporter.save_pyfunc(silo.personalized(), path)
    model = mlflow.pyfunc.load_model(str(path))
    assert not hasattr(model.unwrap_python_model(), "plugins")
    predictions = model.predict(_test_rows(silo))
    assert float(np.mean(predictions == silo.data.y_test)) == pytest.approx(
        silo.outcome().test_accuracy
    )
