"""A registered name `<federation>-<silo>` that two federations reach (both names may hold '-'):
the run whose silo's name is another's fails before round 1, registration refuses to add a
version to another silo's model, and `silo-pfl models` attributes versions by their tags.
Real SQLite stores; the run on a real local Ray."""

from __future__ import annotations

import pytest
from mlflow import MlflowClient

from silo_pfl.cli import main
from silo_pfl.errors import ConfigError, FederationError
from silo_pfl.tracking import registry
from silo_pfl.tracking.exporter import MlflowExporter
from silo_pfl.tracking.listing import model_rows

# Federation `heart` with silo `disease-va` registered `heart-disease-va`, the name federation
# `heart-disease`'s silo `va` would take.
TAKEN, OWNER = "heart-disease-va", {registry.FEDERATION: "heart", registry.SILO: "disease-va"}


def _taken(uri: str) -> MlflowClient:
    """A store holding another federation's model under the name heart-disease-va."""
    client = MlflowClient(uri, registry_uri=uri)
    client.create_registered_model(TAKEN, tags=OWNER)
    return client


@pytest.mark.usefixtures("ray_local")
def test_a_run_whose_silo_model_name_is_another_federations_fails_before_round_one(
    tmp_path, mlflow_store, capsys
):
    client = _taken(mlflow_store)
    capsys.readouterr()  # the store's creation, logged by MLflow in this process
    args = ["run", "jobs/heart_disease.yaml", "name=heart-disease", "rounds=1"]
    code = main([*args, f"output_dir={tmp_path / 'runs'}"])
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert code == 2, captured
    assert err.count("\n") == 0 and "Traceback" not in err
    for text in ("silo va", TAKEN, "federation heart, silo disease-va", "rename"):
        assert text in err, err
    assert "round 1" not in captured.out
    assert client.search_model_versions(f"name = '{TAKEN}'") == []
    assert client.get_experiment_by_name("heart-disease") is None  # checked before it is made


def test_a_silo_whose_own_store_holds_its_name_for_another_fails_its_check(tmp_path):
    uri = f"sqlite:///{tmp_path / 'own.db'}"
    _taken(uri)
    exporter = MlflowExporter(uri, "silos.va.tracking_uri", "heart-disease", "-")
    with pytest.raises(ConfigError, match="silos.va.tracking_uri.*federation heart, silo disease"):
        exporter.check("va")
    MlflowExporter(uri, "silos.va.tracking_uri", "heart", "-").check("disease-va")  # its own


def test_registration_refuses_another_silos_model_of_the_same_name(tmp_path):
    client = _taken(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = client.create_run(client.create_experiment("heart-disease"))
    logged = client.create_logged_model(run.info.experiment_id, source_run_id=run.info.run_id)
    tags = registry.version_tags(
        "heart-disease", "va", "fedper", run.info.run_id, 1, 0.5, 0.5, "rows"
    )
    with pytest.raises(FederationError, match="belongs to federation heart, silo disease-va"):
        registry.register(client, TAKEN, logged.model_id, logged.artifact_location, tags)
    assert client.search_model_versions(f"name = '{TAKEN}'") == []


def test_models_attributes_each_version_by_its_own_tags(tmp_path):
    """As the auditor's store holds them: version 2 of clinic-north-a is clinic-north's silo a,
    registered into clinic's north-a before registration checked its owner."""
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    name = "clinic-north-a"
    client.create_registered_model(name, tags={"federation": "clinic", "silo": "north-a"})
    for federation, silo in (("clinic", "north-a"), ("clinic-north", "a")):
        tags = registry.version_tags(federation, silo, "fedper", "r", 1, 0.5, 0.5, "rows")
        client.create_model_version(name, source=str(tmp_path), tags=tags)
    north = model_rows(client, "clinic-north", every_version=True)
    assert [(r.federation, r.silo, r.version) for r in north] == [("clinic-north", "a", 2)]
    clinic = model_rows(client, "clinic", every_version=True)
    assert [(r.federation, r.silo, r.version) for r in clinic] == [("clinic", "north-a", 1)]


@pytest.mark.usefixtures("ray_local")
def test_a_joining_silo_whose_name_is_taken_fails_before_it_trains(tmp_path, mlflow_store, capsys):
    """The joining silo's name is known only as its onboarding starts: checked there. Here the
    name is taken by a model someone registered by hand (no federation and silo tags)."""
    job, data = "jobs/digits_label_skew.yaml", ["data.num_silos=6", "data.late_silos=[silo_5]"]
    runs = f"output_dir={tmp_path / 'runs'}"
    assert main(["run", job, "rounds=1", runs, *data, "--quiet"]) == 0
    client = MlflowClient(mlflow_store)
    client.create_registered_model("digits_label_skew-silo_5")
    capsys.readouterr()
    code = main(["onboard", job, "--silo", "silo_5", "rounds=1", runs, *data])
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert code == 2, captured
    assert err.count("\n") == 0 and "Traceback" not in err
    assert "silo silo_5" in err and "digits_label_skew-silo_5" in err, err
    assert "no silo of any federation" in err
    experiment = client.get_experiment_by_name("digits_label_skew").experiment_id
    assert len(client.search_runs([experiment])) == 1 + 5  # the founders' run and its silos'
