"""MLflow without Ray: store errors before any work, a silo's export, the champion rule."""

from __future__ import annotations

import socket
import subprocess
import sys

import mlflow
import numpy as np
import pandas as pd
import pytest
from mlflow import MlflowClient

from silo_pfl.cli import main
from silo_pfl.config import to_dict
from silo_pfl.errors import ConfigError, FederationError
from silo_pfl.server_start import new_server
from silo_pfl.settings import load_config
from silo_pfl.silo import Silo
from silo_pfl.tracking.exporter import MlflowExporter
from silo_pfl.tracking.registry import CHAMPION, LATEST, VAL_ACCURACY, VAL_ROWS, promote


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _cli_error(capsys, *overrides: str) -> tuple[int, str, str]:
    code = main(["run", "jobs/heart_disease.yaml", "rounds=2", *overrides])
    captured = capsys.readouterr()
    return code, captured.out, captured.err.strip()


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("tracking.uri=nonsense://x", ("tracking.uri", "nonsense://x")),
        ("tracking.uri=sqlite:///{tmp}/missing/mlflow.db", ("tracking.uri", "missing")),
        ("tracking.uri=http://127.0.0.1:{port}", ("tracking.uri", "no MLflow server answers")),
        (
            "silos.nowhere.tracking_uri=sqlite:///{tmp}/x.db",
            ("silos.nowhere", "cleveland, hungarian, switzerland, va"),
        ),
        ("silos.va.tracking_uri=mlflow.db", ("silos.va.tracking_uri", "sqlite:///mlflow.db")),
    ],
)
def test_bad_tracking_config_is_one_line_before_any_work(tmp_path, capsys, override, expected):
    override = override.format(tmp=tmp_path, port=_closed_port())
    code, out, err = _cli_error(capsys, override, f"output_dir={tmp_path / 'runs'}")
    assert code != 0
    assert err.count("\n") == 0 and "Traceback" not in err
    assert all(text in err for text in expected), err
    assert "round 1" not in out and not (tmp_path / "runs").exists()


def test_a_silos_own_store_out_of_reach_fails_a_fresh_run_that_leaves_no_directory(
    ray_local, tmp_path, capsys
):
    """Only the silo reaches its own store (it may be on its node's network alone), so it checks
    it at set-up; that comes before round 0's checkpoint, so the fresh run has nothing to resume
    and its directory goes, rather than staying as a run that only the bad URI resumes."""
    own = f"http://127.0.0.1:{_closed_port()}"
    central = f"sqlite:///{tmp_path / 'mlflow.db'}"
    overrides = [f"silos.va.tracking_uri={own}", f"tracking.uri={central}"]
    code, out, err = _cli_error(capsys, *overrides, f"output_dir={tmp_path / 'runs'}")
    assert code != 0 and err.count("\n") == 0, err
    assert err.startswith(f"error: silos.va.tracking_uri: no MLflow server answers at {own}")
    assert "round 1" not in out and not (tmp_path / "runs").exists()


def test_unwritable_artifact_location_is_one_line_naming_it(tmp_path, capsys):
    (tmp_path / "mlartifacts").write_text("a file where the artifact directory should be")
    code, out, err = _cli_error(capsys, f"output_dir={tmp_path / 'runs'}")
    assert code != 0
    assert err.count("\n") == 0 and "Traceback" not in err
    assert "tracking.uri" in err and str(tmp_path / "mlartifacts" / "heart_disease") in err
    assert "round 1" not in out


def test_mlflow_is_imported_only_when_tracking_is_enabled():
    code = (
        "import sys\n"
        "import silo_pfl.cli, silo_pfl.federation, silo_pfl.runtime.orchestrator\n"
        "import silo_pfl.tracking.exporter, silo_pfl.tracking.registry, silo_pfl.tracking.tracker\n"
        "from silo_pfl.settings import load_config\n"
        "from silo_pfl.federation import Federation\n"
        "Federation(load_config('jobs/heart_disease.yaml', ['tracking.enabled=false']))\n"
        "assert 'mlflow' not in sys.modules, 'mlflow was imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def _trained_silo(tmp_path, silo: str, *overrides: str) -> Silo:
    """A silo and a server in this process, two rounds: the plain classes, no Ray."""
    cfg = load_config(
        "jobs/heart_disease.yaml",
        [f"output_dir={tmp_path / 'runs'}", "round.min_silos=1", *overrides],
    )
    node = Silo(to_dict(cfg), silo)
    info = node.setup()
    node.build(info.input_shape, info.num_classes)
    server = new_server(to_dict(cfg), info.input_shape, info.num_classes)
    for round_ in (1, 2):
        update, _ = node.fit(server.global_state(), round_)
        assert server.aggregate(update).aggregated
        node.evaluate(server.global_state(), round_)
        node.commit(round_, keep=True)
    return node


def test_silo_exports_its_model_to_its_store_without_ray(tmp_path, monkeypatch):
    store = f"sqlite:///{tmp_path / 'own' / 'mlflow.db'}"
    (tmp_path / "own").mkdir()
    silo = _trained_silo(tmp_path, "switzerland")
    exporter = MlflowExporter(store, "silos.switzerland.tracking_uri", "heart_disease", "-")
    silo.attach({"mlflow": exporter})
    receipt = silo.export()["mlflow"]
    assert receipt["model_uri"] == "models:/heart_disease-switzerland/1"
    assert receipt["champion"] == "true"

    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    model = mlflow.pyfunc.load_model("models:/heart_disease-switzerland@champion")
    rows = pd.DataFrame(silo.data.x_test_raw, columns=list(silo.data.raw_columns))
    predicted = model.predict(rows)
    assert np.mean(predicted == silo.data.y_test) == pytest.approx(silo.outcome().test_accuracy)
    probabilities = model.predict(rows, params={"probabilities": True})
    assert list(probabilities.columns) == ["class", "p_0", "p_1"]
    np.testing.assert_allclose(probabilities[["p_0", "p_1"]].sum(axis=1), 1.0, rtol=1e-5)
    with pytest.raises(Exception, match="chol"):
        model.predict(rows.drop(columns=["chol"]))


def test_a_sqlite_store_path_with_an_escaped_dollar_is_the_directory_sqlalchemy_opens(tmp_path):
    """A literal $ in a silo's store URI is written %24 (a bare $NAME is a variable): the store,
    its checks and its artifacts are all in the directory named with the $."""
    own = tmp_path / "pa$word"
    own.mkdir()
    store = f"sqlite:///{tmp_path}/pa%24word/mlflow.db"
    silo = _trained_silo(tmp_path, "va")
    silo.attach({"mlflow": MlflowExporter(store, "silos.va.tracking_uri", "heart_disease", "-")})
    assert silo.export()["mlflow"]["model_uri"] == "models:/heart_disease-va/1"
    assert (own / "mlflow.db").is_file() and (own / "mlartifacts").is_dir()
    # MLflow itself makes the raw name's directory, empty (mlflow.store.db.utils)
    assert not any((tmp_path / "pa%24word").glob("*"))


def test_champion_is_the_best_version_on_the_newest_versions_validation_rows(tmp_path):
    """On the champion's rows a version must beat it; on other rows (another split) the alias
    goes to the best version scored on those rows, and back when a version on the first rows
    comes again; a version with no validation rows' digest is never compared."""
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    client.create_registered_model("fed-silo")
    steps = [
        (0.8, "a"),  # 1: the first version
        (0.7, "a"),  # 2: worse on the same rows
        (0.8, "a"),  # 3: equal: the champion stays
        (0.6, "b"),  # 4: other rows: the only version scored on them
        (0.5, "b"),  # 5: worse on b
        (0.9, "b"),  # 6: better on b
        (0.1, "a"),  # 7: rows a again: the best on a, version 1
        (0.95, None),  # 8: no digest, nothing to compare it with: the newest takes the alias
    ]
    champions, claimed = [], []
    for accuracy, rows in steps:
        tags = {VAL_ACCURACY: repr(accuracy), **({VAL_ROWS: rows} if rows else {})}
        version = client.create_model_version("fed-silo", source=str(tmp_path), tags=tags).version
        claimed.append(promote(client, "fed-silo", version))
        champions.append(str(client.get_model_version_by_alias("fed-silo", CHAMPION).version))
    assert champions == ["1", "1", "1", "4", "4", "6", "1", "8"]
    assert claimed == [True, False, False, True, False, True, False, True]
    assert str(client.get_model_version_by_alias("fed-silo", LATEST).version) == "8"


def test_a_version_scored_on_another_seeds_validation_rows_is_not_ranked_against_them(tmp_path):
    """Two seeds split the silo's rows differently: the second seed's version takes the alias
    although its validation accuracy is not higher, and the first seed's again gives it back to
    the first version (the same rows, an equal score)."""
    store = f"sqlite:///{tmp_path / 'own' / 'mlflow.db'}"
    (tmp_path / "own").mkdir()
    trained = [
        _trained_silo(tmp_path / str(seed), "switzerland", f"seed={seed}") for seed in (0, 1)
    ]
    first, second = sorted(trained, key=lambda silo: -silo.outcome().val_accuracy)
    assert first.data.validation_digest() != second.data.validation_digest()
    receipts = []
    for run, silo in enumerate((first, second, first)):  # three federation runs
        key = "silos.switzerland.tracking_uri"
        exporter = MlflowExporter(store, key, "heart_disease", f"run-{run}")
        silo.attach({"mlflow": exporter})
        receipts.append(silo.export()["mlflow"])
    assert [r["champion"] for r in receipts] == ["true", "true", "false"]
    client = MlflowClient(store)
    champion = client.get_model_version_by_alias("heart_disease-switzerland", CHAMPION)
    assert str(champion.version) == "1"
    for version, silo in zip(("1", "2", "3"), (first, second, first), strict=True):
        tags = client.get_model_version("heart_disease-switzerland", version).tags
        assert tags[VAL_ROWS] == silo.data.validation_digest()
        assert float(tags[VAL_ACCURACY]) == silo.outcome().val_accuracy


def _other_sqlite(path) -> bytes:
    """A SQLite file of something else than MLflow (one table of patients); its bytes."""
    import sqlite3

    with sqlite3.connect(path) as db:
        db.execute("create table patients(id int)")
    return path.read_bytes()


def test_a_run_refuses_a_sqlite_file_of_another_database_and_leaves_it_untouched(tmp_path, capsys):
    """MLflow would add its whole schema to an application's database."""
    path = tmp_path / "app.db"
    before = _other_sqlite(path)
    code, _, err = _cli_error(capsys, f"tracking.uri=sqlite:///{path}", f"output_dir={tmp_path}")
    assert code == 2 and "\n" not in err and "Traceback" not in err
    assert f"{path} is not an MLflow store (no alembic_version or experiments table)" in err, err
    assert "or at a new file for a new store" in err
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["app.db"]


@pytest.mark.parametrize("content", ["other", "empty"])
@pytest.mark.parametrize("command", ["models", "report"])
def test_reading_a_sqlite_file_that_is_no_mlflow_store_leaves_it_untouched(
    tmp_path, capsys, command, content
):
    path = tmp_path / "other.db"
    if content == "other":
        before = _other_sqlite(path)
    else:
        path.touch()
        before = b""
    uri = f"sqlite:///{path}"
    args = ["models"] if command == "models" else ["report", "0" * 32, "--out", str(tmp_path / "r")]
    code = main([*args, "--tracking-uri", uri])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.count("\n") == 0 and "Traceback" not in err
    assert f"{path} is not an MLflow store" in err and "--tracking-uri" in err, err
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.db"]


def test_models_lists_every_page_of_registered_models(tmp_path, monkeypatch, capsys):
    """More registered models than one search page holds (the page made small here)."""
    from silo_pfl.tracking import registry
    from silo_pfl.tracking.listing import model_rows

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri, registry_uri=uri)
    silos = [f"s{i}" for i in range(7)]
    for federation in ("aaa", "zzz"):
        for silo in silos:
            name = registry.model_name(federation, silo)
            client.create_registered_model(name, tags={"federation": federation, "silo": silo})
            tags = registry.version_tags(federation, silo, "fedper", "r", 1, 0.5, 0.5, "rows")
            for _ in range(3):
                client.create_model_version(name, source=str(tmp_path), tags=tags)
    monkeypatch.setattr(registry, "PAGE_SIZE", 2)
    rows = model_rows(client, "zzz", every_version=True)
    assert [(r.silo, r.version) for r in rows] == [(s, v) for s in silos for v in (3, 2, 1)]
    assert len(model_rows(client)) == 2 * len(silos)
    capsys.readouterr()
    assert main(["models", "--tracking-uri", uri, "--federation", "zzz"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 1 + len(silos)
    # A federation with no model in the store (a typo) is an error, not an empty listing.
    assert main(["models", "--tracking-uri", uri, "--federation", "zz"]) == 2
    assert capsys.readouterr().err == (
        f"error: --federation zz: no registered silo models of it in {uri}\n"
    )
    # The check before round 1 reads every page too: zzz-s70 is on the last one.
    client.create_registered_model("zzz-s70", tags={"federation": "zzz-s", "silo": "70"})
    with pytest.raises(ConfigError, match="zzz-s70 .* federation zzz-s, silo 70"):
        registry.check_owner(client, "zzz", ["s70"], "the store")


def test_a_silo_that_cannot_reach_the_central_tracking_server_says_so_before_round_1(tmp_path):
    """The silo writes its model's files through the central server at the end: a node that
    cannot reach it is named before any round trains, not after every one has."""
    from serving import free_port

    port = free_port()  # nothing listens there
    uri = f"http://127.0.0.1:{port}"
    exporter = MlflowExporter(
        uri, "tracking.uri", "heart_disease", "run", "run", "model", "mlflow-artifacts:/1/m"
    )
    with pytest.raises(FederationError) as info:
        exporter.check("va")
    assert str(info.value).startswith(f"tracking.uri: no MLflow server answers at {uri} (")
