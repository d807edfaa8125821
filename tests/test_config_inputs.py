"""Inputs a user audit found unchecked: each is now one line at load naming the key and what is
allowed, in process and without Ray."""

from __future__ import annotations

from pathlib import Path

import pytest

from silo_pfl.cli import main
from silo_pfl.config import check_name
from silo_pfl.errors import ConfigError
from silo_pfl.settings import check_files_apart, load_config
from silo_pfl.tracking.uri import check_uri

ROOT = Path(__file__).resolve().parents[1]
JOB = str(ROOT / "jobs" / "heart_disease.yaml")  # mlp, fedper
QUIET = ["tracking.enabled=false"]


LINGER = "a number of seconds from 0 to 600"
EVERY = "a number of seconds from 1 to 600"


def refused(*overrides: str, job: str | Path = JOB) -> str:
    """The one-line ConfigError that loading `job` with `overrides` raises."""
    with pytest.raises(ConfigError) as info:
        load_config(job, [*QUIET, *overrides])
    message = str(info.value)
    assert "\n" not in message
    return message


def cli_error(capsys, tmp_path: Path, job: str | Path, *overrides: str) -> str:
    """`silo-pfl run` refusing the job: exit 2, one line on stderr, no run directory."""
    runs = tmp_path / "runs"
    code = main(["run", str(job), "rounds=2", *QUIET, f"output_dir={runs}", *overrides])
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in captured.err, captured.err
    assert captured.out == "" and not runs.exists()
    return lines[0].removeprefix("error: ")


# 1. The federation's and the silos' names become directories and MLflow names.


@pytest.mark.parametrize(
    "name", ["../../escape", "a/b", "a\\b", "..", ".hidden", "a..b", "x:y", "a b", "-x", "x" * 64]
)
def test_a_name_that_is_no_plain_path_component_is_refused(name):
    message = refused(f"name='{name}'")
    assert message.startswith(f"name: got {name!r}, expected 1 to 63 letters, digits")


def test_an_escaping_name_is_refused_before_anything_is_written(tmp_path, capsys):
    message = cli_error(capsys, tmp_path, JOB, "name=../../escape")
    assert message.startswith("name: got '../../escape', expected ")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["heart_disease", "a", "Fed-1.v2", "x" * 63])
def test_plain_names_pass(name):
    assert load_config(JOB, [*QUIET, f"name={name}"]).name == name
    check_name(name, "name")


def test_check_name_names_the_key_and_what_the_value_is():
    with pytest.raises(ConfigError, match=r"^silos: got silo name 'a/b', expected 1 to 63"):
        check_name("a/b", "silos", "silo name ")


def test_a_csv_silo_name_that_is_no_plain_path_component_is_refused(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(
        "name: csv_names\nrounds: 1\nmodel: {name: mlp}\nalgorithm: {name: fedavg}\n"
        "data:\n  source: csv\n  num_classes: 2\n  paths:\n"
        f"    good: {tmp_path / 'a.csv'}\n    ../evil: {tmp_path / 'b.csv'}\n"
    )
    assert refused(job=job).startswith("data.paths: got silo name '../evil', expected 1 to 63")


def test_two_silos_reading_one_file_on_one_machine_are_refused(tmp_path, capsys, monkeypatch):
    """Each silo splits its file its own way: one file for two silos puts one silo's test rows
    in the other's training rows. On a cluster one path names each node's own file, so a job
    loaded for `submit` (on a machine of its own) or one joining a cluster is not refused."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    job = tmp_path / "job.yaml"
    job.write_text(
        "name: csv_twice\nrounds: 1\nmodel: {name: mlp}\nalgorithm: {name: fedavg}\n"
        "data:\n  source: csv\n  num_classes: 2\n  paths:\n"
        f"    a: {tmp_path / 'x.csv'}\n    b: {tmp_path / 'y.csv'}\n"
        f"    c: {tmp_path / 'sub' / '..' / 'x.csv'}\n"
    )
    assert cli_error(capsys, tmp_path, job) == (
        f"data.paths.c: names the file of silo a ({tmp_path / 'x.csv'}); each silo reads a file "
        "of its own rows, or rows would be in two silos"
    )
    pinned = [*QUIET, "ray.placement=per_node"]
    check_files_apart(load_config(job, [*pinned, "ray.address=10.0.0.1:6379"]))
    code = main(["submit", str(job), "--address", "http://127.0.0.1:9", "--no-wait", *pinned])
    err = capsys.readouterr().err
    assert code != 0 and "--address http://127.0.0.1:9" in err and "data.paths" not in err, err


@pytest.mark.parametrize(
    "placement",
    [
        [],
        ["silos.a.node_label={site: one}", "silos.c.node_label={site: one}"],
        ["silos.a.node_label={site: one}", "silos.c.node_label={site: one, gpu: 'yes'}"],
    ],
    ids=["any-node", "one-label", "overlapping-labels"],
)
def test_two_silos_that_may_share_a_clusters_node_may_not_read_one_path(
    tmp_path, capsys, placement
):
    """On a cluster one path names each node's own file, but silos not pinned to nodes of their
    own may run on one node (ray.placement=any; packed in one worker, they always do), and read
    one file there. Refused as the job is submitted and as a run joins the cluster."""
    job = tmp_path / "job.yaml"
    job.write_text(
        "name: csv_shared\nrounds: 1\nmodel: {name: mlp}\nalgorithm: {name: fedavg}\n"
        "data:\n  source: csv\n  num_classes: 2\n  paths:\n"
        "    a: /data/heart.csv\n    b: /data/other.csv\n    c: /data/./heart.csv\n"
    )
    expected = (
        "data.paths.c: names the path of silo a (/data/heart.csv), which is each node's own "
        "file only for silos on nodes of their own, and these two may share one; pin each: "
        "ray.placement=per_node, or silos.<name>.node_label"
    )
    with pytest.raises(ConfigError) as info:
        check_files_apart(load_config(job, [*QUIET, *placement, "ray.address=10.0.0.1:6379"]))
    assert str(info.value) == expected
    code = main(
        ["submit", str(job), "--address", "http://127.0.0.1:9", "--no-wait", *QUIET, *placement]
    )
    assert code == 2 and capsys.readouterr().err == f"error: {expected}\n"


# 2. MLflow's file store no longer opens: a file: URI is refused at load.


@pytest.mark.parametrize("uri", ["databricks", "databricks://my-profile"])
def test_mlflows_databricks_store_is_taken_as_mlflow_writes_it(uri):
    """MLflow's own form is the bare word `databricks`, which has no scheme to parse."""
    assert check_uri(f" {uri} ", "tracking.uri") == uri


def test_a_file_store_uri_is_refused_at_load_listing_the_schemes_that_work():
    message = refused("tracking.uri=file:///tmp/x/fstore")
    assert message.startswith("tracking.uri: got 'file:///tmp/x/fstore', expected an MLflow")
    assert "sqlite, postgresql" in message and "file," not in message
    assert "sqlite:///PATH" in message


def test_a_file_store_in_the_environment_is_named_as_such(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "file:///tmp/x/fstore")
    message = refused()
    assert message.startswith("tracking.uri (from $MLFLOW_TRACKING_URI): got 'file:///tmp/x/")


# 3. Numbers out of the range where training makes sense.


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("train.momentum=5", "train.momentum: got 5.0, expected 0 <= value < 1"),
        ("train.momentum=1", "train.momentum: got 1.0, expected 0 <= value < 1"),
        ("train.lr=inf", "train.lr: got inf, expected a number > 0"),
        ("train.weight_decay=inf", "train.weight_decay: got inf, expected a number >= 0"),
        ("server.lr=inf", "server.lr: got inf, expected a number > 0, or null"),
        ("server.tau=inf", "server.tau: got inf, expected a number > 0"),
        ("algorithm.fedprox.mu=nan", "algorithm.fedprox.mu: got nan, expected a finite number"),
        ("algorithm.ditto.lam=inf", "algorithm.ditto.lam: got inf, expected a finite number"),
        ("metrics.linger_s=inf", f"metrics.linger_s: got inf, expected {LINGER}"),
        ("metrics.linger_s=1e12", f"metrics.linger_s: got 1000000000000.0, expected {LINGER}"),
        ("metrics.export_interval_s=inf", f"metrics.export_interval_s: got inf, expected {EVERY}"),
        (
            "metrics.export_interval_s=601",
            f"metrics.export_interval_s: got 601.0, expected {EVERY}",
        ),
    ],
)
def test_numbers_out_of_range_are_refused(override, expected):
    assert refused(override) == expected


def test_momentum_is_refused_in_the_cli_before_ray(tmp_path, capsys):
    message = cli_error(capsys, tmp_path, JOB, "train.momentum=5")
    assert message == "train.momentum: got 5.0, expected 0 <= value < 1"


@pytest.mark.parametrize("momentum", ["0", "0.9", "0.99"])
def test_usual_momentum_passes(momentum):
    assert load_config(JOB, [*QUIET, f"train.momentum={momentum}"]).train.momentum < 1


# 4. An empty model.hidden: mlp is then its head alone (a linear model, fine for fedavg).


def test_an_empty_hidden_list_is_blamed_where_it_leaves_the_split_nothing():
    message = refused("model.hidden=[]")
    assert message.startswith(
        "model.hidden: got [], so model mlp has no hidden layer, only its head, and "
        "split.local=[head] leaves no global keys"
    )
    assert "model.hidden=[32]" in message


def test_an_empty_hidden_list_is_a_linear_model_for_fedavg():
    cfg = load_config(JOB, [*QUIET, "model.hidden=[]", "algorithm.name=fedavg"])
    assert list(cfg.model.hidden) == []


def test_a_split_that_fails_with_hidden_layers_too_still_names_split_local():
    message = refused("model.hidden=[]", "algorithm.name=fedavg", "split.local=[all]")
    assert message.startswith("split.local: split.local=[all] leaves no global keys")


@pytest.mark.parametrize(
    ("hidden", "expected"),
    [
        ("[0]", "model.hidden: got [0], expected widths from 1 to 16384"),
        ("[16,-2]", "model.hidden: got [16, -2], expected widths from 1 to 16384"),
        ("[1.5]", "model.hidden[0]: got '1.5', expected a value of type integer"),
        ("[32,100000]", "model.hidden: got [32, 100000], expected widths from 1 to 16384"),
    ],
)
def test_hidden_widths_are_positive_integers(hidden, expected):
    """A width past the bound is refused before any model is built (the split's probe would
    allocate it here, and every silo again)."""
    assert refused(f"model.hidden={hidden}") == expected


def test_digits_images_are_at_most_256_pixels_a_side():
    message = refused("data.source=digits", "model.name=resnet18", "data.image_shape=[3,4096,4096]")
    assert message == (
        "data.image_shape: got [3, 4096, 4096], expected [C, S, S] with C 1 or 3 and S a multiple "
        "of 8 up to 256 (the 8x8 digits, each pixel repeated S/8 times)"
    )


# 5. A config file whose top level is a scalar.


@pytest.mark.parametrize("text", ["just a string\n", "42\n", "true\n", "3.5\n", "~\n"])
def test_a_scalar_config_file_is_named(tmp_path, capsys, text):
    path = tmp_path / "scalar.yaml"
    path.write_text(text)
    expected = f"config file {path}: expected a mapping of keys at the top level"
    assert refused(job=path) == expected
    assert cli_error(capsys, tmp_path, path) == expected


def test_an_empty_config_file_still_reads_as_no_keys(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing yet\n")
    assert refused(job=path) == "name: required value is missing"


@pytest.mark.parametrize("selection", ["best_mean_val", "best_val"])
def test_a_selection_on_validation_rows_needs_some(selection):
    with pytest.raises(ConfigError) as info:
        load_config(JOB, ["data.val_fraction=0", f"eval.selection={selection}"])
    assert str(info.value) == (
        f"eval.selection: got {selection!r}, which selects on validation rows, but "
        "data.val_fraction=0 leaves none; set data.val_fraction > 0 (e.g. 0.2) or "
        "eval.selection=last"
    )
    assert load_config(JOB, ["data.val_fraction=0", "eval.selection=last"]).eval.every == 1


# From the onboarding and input audit of 2026-12-06.


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        (
            "model.hidden=[32",
            "override 'model.hidden=[32': model.hidden: its value is not valid YAML (an unclosed",
        ),
        ("rounds=[", "override 'rounds=[': rounds: its value is not valid YAML"),
        ("data=abc", "data: got 'abc', expected a mapping, e.g. {source: heart_disease"),
        ("data=3", "data: got 3, expected a mapping"),
        (".rounds=3", "override '.rounds=3': expected key=value, e.g. rounds=5"),
        ("a..b=1", "override 'a..b=1': expected key=value"),
        ("model.hidden=[[32]]", "model.hidden: got [[32]], expected a list of widths"),
        ("tracking.uri=::", "tracking.uri: got a mapping, expected a single value (quote it"),
    ],
)
def test_a_malformed_override_is_one_line_naming_it(tmp_path, capsys, override, expected):
    assert cli_error(capsys, tmp_path, JOB, override).startswith(expected)


def test_the_python_api_checks_a_config_however_it_was_built(tmp_path):
    """A loaded config changed afterwards, or one built by hand, is checked again: before, the
    first went to the silos unchecked and failed there ('its worker holds no silos'), the second
    failed with an AttributeError."""
    from silo_pfl import Federation
    from silo_pfl.config import FederationConfig, ModelConfig, TrackingConfig

    cfg = load_config(JOB, [*QUIET, f"output_dir={tmp_path}"])
    cfg.rounds = 0
    with pytest.raises(ConfigError, match="rounds: got 0, expected an integer >= 1"):
        Federation(cfg)
    built = FederationConfig(
        name="x",
        rounds=2,
        data={"source": "heart_disease"},
        model=ModelConfig(name="mlp"),
        tracking=TrackingConfig(enabled=False),
    )
    assert Federation(built).config.data.source == "heart_disease"
    with pytest.raises(TypeError, match="config: got int, expected a FederationConfig"):
        Federation(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="overrides: got 'rounds=2', expected a list"):
        Federation(JOB, "rounds=2")  # type: ignore[arg-type]
    assert Federation(JOB, None).config.rounds == Federation(JOB).config.rounds  # None: none
    with pytest.raises(ConfigError, match=r"^overrides\[1\]: got 5, expected a 'key=value' "):
        Federation(JOB, ["rounds=2", 5])  # type: ignore[list-item]


def test_a_mapping_may_hold_numpy_numbers(tmp_path):
    """A config made in Python often holds numpy's scalars (from a sweep, say): before, they
    were refused as 'not a supported primitive type'."""
    import numpy as np

    from silo_pfl import Federation

    config = {
        "name": "sweep",
        "rounds": np.int64(2),
        "output_dir": str(tmp_path),
        "data": {"source": "heart_disease", "val_fraction": np.float64(0.2)},
        "model": {"name": "mlp", "hidden": [np.int32(8)]},
        "train": {"lr": np.float32(0.05)},
        "tracking": {"enabled": False},
    }
    cfg = Federation(config).config
    assert (cfg.rounds, cfg.model.hidden, cfg.data.val_fraction) == (2, [8], 0.2)
    assert type(cfg.rounds) is int and cfg.train.lr == pytest.approx(0.05)


def test_one_training_row_under_batchnorm_is_one_line_at_build(tmp_path):
    """Every round failed with torch's 'Expected more than 1 value per channel'."""
    from silo_pfl.config import to_dict
    from silo_pfl.errors import FederationError
    from silo_pfl.silo import Silo

    job = ROOT / "jobs" / "digits_feature_shift.yaml"  # cnn_small_bn
    overrides = ["data.num_silos=2", "data.max_train_rows=1", f"output_dir={tmp_path}"]
    silo = Silo(to_dict(load_config(job, [*QUIET, *overrides])), "silo_0")
    info = silo.setup()
    with pytest.raises(FederationError, match=r"^silo silo_0: 1 training row, but model cnn_sm"):
        silo.build(info.input_shape, info.num_classes)


@pytest.mark.parametrize("where", ["ray.address=10.0.0.1:6379", "RAY_ADDRESS"])
def test_a_silo_whose_file_names_a_node_variable_is_pinned_to_its_node_on_a_cluster(
    monkeypatch, where
):
    """$SILO_PFL_DATA_DIR/heart.csv is each node's own file: a silo that Ray may run on any node
    of a cluster would read another institution's. Pinned (per_node, a node label), or on a
    local Ray, it is accepted."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    joins = [where] if where.startswith("ray.") else []
    if not joins:
        monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    job = "jobs/hospitals_on_nodes.yaml"
    with pytest.raises(ConfigError) as caught:
        load_config(job, ["ray.placement=any", *joins])
    assert str(caught.value) == (
        "data.paths.cleveland: $SILO_PFL_DATA_DIR/heart.csv names an environment variable, which "
        "each node fills in from its own, but silo cleveland may run on any node of the cluster "
        "(ray.placement=any), where it would read that node's; pin it: ray.placement=per_node, "
        "or silos.cleveland.node_label"
    )
    load_config(job, joins)  # per_node, as the job says
    labels = [f"silos.{s}.node_label={{site: {s}}}" for s in ("cleveland", "hungarian")]
    load_config(job, ["ray.placement=any", *labels, *joins])
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    load_config(job, ["ray.placement=any"])  # a local Ray: one node


@pytest.mark.parametrize("dim", ["99999999999999999999", "20000"])
def test_an_adapter_width_beyond_the_widest_layer_is_one_line(capsys, tmp_path, dim):
    """99999999999999999999 overflowed torch's allocation: 16 lines of a C++ stack, exit 1."""
    message = cli_error(capsys, tmp_path, JOB, "model.name=transformer", f"model.adapter_dim={dim}")
    assert message == f"model.adapter_dim: got {dim}, expected 0 to 16384"


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("aggregation.secure=2", "aggregation.secure: got 2, expected true or false"),
        ("metrics.enabled=0", "metrics.enabled: got 0, expected true or false, or null"),
    ],
)
def test_a_number_given_for_a_yes_or_no_setting_is_refused(override, expected):
    """OmegaConf took 2 as true and 0 as false."""
    assert refused(override) == expected


@pytest.mark.parametrize(
    ("lines", "expected"),
    [
        ("aggregation: {secure: 1}", "aggregation.secure: got 1, expected true or false"),
        ("metrics: {enabled: 0}", "metrics.enabled: got 0, expected true or false, or null"),
    ],
)
def test_a_number_for_a_yes_or_no_setting_in_the_job_file_is_refused(tmp_path, lines, expected):
    """The job's YAML took 1 as true and 2 as true, where an override was refused."""
    job = tmp_path / "job.yaml"
    job.write_text(Path(JOB).read_text() + lines + "\n")
    assert refused(job=job) == f"config file {job}: {expected}"
