"""What each actor is given of the config, and what is logged of it."""

from __future__ import annotations

import pytest

from silo_pfl.config import to_dict
from silo_pfl.config_views import HIDDEN, actor_view, logged_view
from silo_pfl.errors import ConfigError
from silo_pfl.settings import from_dict, load_config, resolved_config
from silo_pfl.tracking.tracker import flatten
from silo_pfl.tracking.uri import redact

SECRET_URI = "http://alice:s3cret@mlflow.example:5000/?token=t0ken&region=eu"
SILOS = ("alpha", "beta", "gamma")


def _csv_config(tmp_path) -> dict:
    """A CSV federation of three silos, one with a store URI holding a password and a token."""
    lines = ["name: views", "rounds: 1", "model: {name: mlp}", "data:", "  source: csv"]
    lines += ["  num_classes: 2", "  paths:"]
    for name in SILOS:
        path = tmp_path / f"{name}.csv"
        path.write_text("a,label\n" + "".join(f"{i},{i % 2}\n" for i in range(8)))
        lines.append(f"    {name}: {path}")
    job = tmp_path / "job.yaml"
    job.write_text("\n".join(lines) + "\n")
    return to_dict(
        load_config(
            str(job),
            [
                f"silos.alpha.tracking_uri={SECRET_URI}",
                f"silos.beta.key_dir={tmp_path / 'keys'}",
                f"tracking.uri={SECRET_URI}",
            ],
        )
    )


def test_an_actor_gets_only_its_own_silos_sections_and_paths(tmp_path):
    config = _csv_config(tmp_path)
    view = actor_view(config, ["beta"])
    assert view["data"]["paths"] == {
        "alpha": HIDDEN,
        "beta": config["data"]["paths"]["beta"],
        "gamma": HIDDEN,
    }
    assert view["silos"]["beta"] == config["silos"]["beta"]
    assert view["silos"]["alpha"] == {}  # not alpha's store, nor anything else of it
    assert SECRET_URI not in str(view["silos"])
    assert config["data"]["paths"]["alpha"] != HIDDEN  # the driver's own config is untouched
    # The view is a valid config: the silo rebuilds it and knows every silo's name.
    rebuilt = from_dict(view)
    assert list(rebuilt.data.paths) == list(SILOS)
    server = actor_view(config, ())
    assert set(server["data"]["paths"].values()) == {HIDDEN}


def test_other_silos_public_identity_keys_stay_visible():
    config = {"silos": {"a": {"identity_key": "KEY", "key_dir": "/k"}, "b": {}}, "data": {}}
    assert actor_view(config, ["b"])["silos"] == {"a": {"identity_key": "KEY"}, "b": {}}


def test_what_is_logged_masks_every_secret_and_lists_paths_by_silo(tmp_path):
    config = _csv_config(tmp_path)
    params = flatten(logged_view(config))
    text = str(params)
    for secret in ("s3cret", "t0ken", str(tmp_path / "alpha.csv")):
        assert secret not in text
    assert params["data.paths"] == "alpha,beta,gamma"
    assert params["tracking.uri"] == "http://alice:***@mlflow.example:5000/?token=***&region=eu"
    assert params["silos.alpha.tracking_uri"] == params["tracking.uri"]


def test_redact_masks_passwords_and_secret_query_values_only():
    assert redact("sqlite:///runs/mlflow.db") == "sqlite:///runs/mlflow.db"
    assert redact("sqlite:////tmp/m.db?mode=ro") == "sqlite:////tmp/m.db?mode=ro"
    assert redact("postgresql://u:pw@h/db?sslpassword=x&sslmode=require") == (
        "postgresql://u:***@h/db?sslpassword=***&sslmode=require"
    )
    assert redact("https://h/p?SIG=1&api_key=2&page") == "https://h/p?SIG=***&api_key=***&page"


@pytest.mark.parametrize(
    ("key", "uri"),
    [
        ("tracking.uri", "postgres://alice:S3cretPW@db.example:5432/mlflow"),
        ("silos.va.tracking_uri", "htp://alice:S3cretPW@host/x?token=S3cretPW"),
    ],
)
def test_a_store_uri_refused_for_its_scheme_masks_its_password(key, uri):
    """`postgres://` (not SQLAlchemy's postgresql://) is the likeliest typo of a database store:
    its refusal goes to terminals and job logs, without the password."""
    with pytest.raises(ConfigError) as info:
        load_config("jobs/heart_disease.yaml", [f"{key}={uri}", "tracking.enabled=true"])
    assert "S3cretPW" not in str(info.value)
    assert str(info.value).startswith(f"{key}: got '{redact(uri)}', expected an MLflow store URI")


def test_an_escaped_interpolation_stays_literal_through_every_merge(tmp_path, capsys):
    r"""`\${NAME}` is OmegaConf's literal `${NAME}`, and `${NAME}` is how a path names a node's
    variable. The driver merges it once; a data source's section, an actor's rebuild and
    `silo-pfl config`'s output read back as a job merge it again, and read it as written. Before,
    the second merge took it for an interpolation: a 4-line error naming paths.s1, or every
    actor failing at set-up."""
    from silo_pfl.cli import main

    path = tmp_path / "alpha.csv"
    path.write_text("a,label\n" + "".join(f"{i},{i % 2}\n" for i in range(8)))
    job = tmp_path / "job.yaml"
    job.write_text(
        "name: literal\nrounds: 1\nmodel: {name: mlp}\ndata:\n  source: csv\n  num_classes: 2\n"
        "  paths:\n"
        f"    alpha: {path}\n    beta: \\${{DATA_DIR}}/beta.csv\n"
    )
    overrides = [r"silos.beta.key_dir=\${HOME}/keys", f"output_dir={tmp_path}/\\${{RUN}}"]
    cfg = load_config(str(job), overrides)
    assert cfg.data.paths["beta"] == "${DATA_DIR}/beta.csv"
    assert cfg.silos["beta"].key_dir == "${HOME}/keys"
    actor = from_dict(actor_view(to_dict(cfg), ["beta"]))
    assert actor.data.paths["beta"] == "${DATA_DIR}/beta.csv"
    assert (actor.silos["beta"].key_dir, actor.output_dir) == (
        "${HOME}/keys",
        f"{tmp_path}/${{RUN}}",
    )
    assert main(["config", str(job), *overrides]) == 0
    printed = tmp_path / "printed.yaml"
    printed.write_text(capsys.readouterr().out)
    again = load_config(str(printed))
    assert resolved_config(again) == resolved_config(cfg)
    assert again.silos["beta"].key_dir == "${HOME}/keys"


def test_an_actor_sees_every_silos_node_labels_and_so_the_placement_the_driver_checked():
    """Under per_node, cleveland is pinned to the node labelled hungarian and hungarian to the
    one labelled cleveland: the driver accepts it. An actor, rebuilding the config, checks the
    placement again; hiding the other silo's label made it read the default (its own name) and
    refuse the set-up with a conflict the driver never saw."""
    pins = [
        "silos.cleveland.node_label={silo: hungarian}",
        "silos.hungarian.node_label={silo: cleveland}",
    ]
    cfg = load_config("jobs/heart_disease.yaml", ["ray.placement=per_node", *pins])
    for silo in ("cleveland", "hungarian"):
        rebuilt = from_dict(actor_view(to_dict(cfg), [silo]))
        assert rebuilt.silos["cleveland"].node_label == {"silo": "hungarian"}
        assert rebuilt.silos["hungarian"].node_label == {"silo": "cleveland"}
