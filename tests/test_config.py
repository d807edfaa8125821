"""Configuration: overrides work, and every kind of bad input is one line naming the key."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from silo_pfl.config import FederationConfig, flat
from silo_pfl.errors import ConfigError
from silo_pfl.settings import load_config, resolved_config

ROOT = Path(__file__).resolve().parents[1]
JOB = str(ROOT / "jobs" / "heart_disease.yaml")


def test_overrides_reach_the_config():
    cfg = load_config(JOB, ["algorithm.name=fedrep", "rounds=7", "seed=11"])
    assert (cfg.algorithm["name"], cfg.rounds, cfg.seed) == ("fedrep", 7, 11)
    assert cfg.algorithm["fedrep"].head_epochs == 5  # the algorithm's defaults are filled in


def test_algorithm_name_override_works_on_a_job_with_another_algorithms_options():
    cfg = load_config(str(ROOT / "jobs" / "digits_label_skew.yaml"), ["algorithm.name=fedavg"])
    assert cfg.algorithm["name"] == "fedavg"
    assert cfg.algorithm["fedper"].head_warmup_epochs == 1


def test_every_job_loads():
    for job in sorted((ROOT / "jobs").glob("*.yaml")):
        assert load_config(job).rounds >= 1


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["roundz=3"], "roundz: unknown key; allowed: name, rounds, seed"),
        (["train.lrate=0.1"], "train.lrate: unknown key; allowed: local_epochs, batch_size"),
        (["silos.cleveland.uri=x"], "silos.cleveland.uri: unknown key; allowed: tracking_uri"),
        (["train.lr=fast"], "train.lr"),
        (["rounds=0"], "rounds: got 0, expected an integer >= 1"),
        (["train.lr=-0.1"], "train.lr: got -0.1, expected a number > 0"),
        (["algorithm.name=fedmagic"], "algorithm.name: got 'fedmagic', expected one of"),
        (["algorithm.name=mine"], "scaffold, or one of your own, its module listed in plugins"),
        (
            ["algorithm.name=mine", "plugins=[tests.canary_plugins]"],
            "scaffold, or one of your own, its module listed in plugins",
        ),
        (["model.name=vit"], "model.name: got 'vit', expected one of"),
        (["algorithm.head_epochs=2"], "algorithm.head_epochs: unknown key; expected name or"),
        (
            ["algorithm.fedrep.head_epoch=2"],
            "algorithm.fedrep.head_epoch: unknown option of fedrep",
        ),
        (["algorithm.fedper.head_warmup_epochs=-1"], "algorithm.fedper.head_warmup_epochs: got -1"),
        (["algorithm.fedprox.mu=-0.5"], "algorithm.fedprox.mu: got -0.5, expected >= 0"),
        (["algorithm.ditto.personal_epochs=-1"], "algorithm.ditto.personal_epochs: got -1"),
        (
            ["algorithm.ditto.personal_epochs=0"],
            "algorithm.ditto.personal_epochs: got 0, expected >= 1",
        ),
        (
            ["algorithm.apfl.personal_epochs=0"],
            "algorithm.apfl.personal_epochs: got 0, expected >= 1",
        ),
        (["algorithm.fedrep.head_epochs=0"], "algorithm.fedrep.head_epochs: got 0, expected >= 1"),
        (["algorithm.fedrep.body_epochs=0"], "algorithm.fedrep.body_epochs: got 0, expected >= 1"),
        (
            ["algorithm.name=apfl", "data.val_fraction=0", "eval.selection=last"],
            "algorithm.apfl.alpha: grid chooses alpha on each silo's validation rows, but "
            "data.val_fraction=0 leaves none",
        ),
        (
            ["algorithm.name=local", "split.local=[head]"],
            "split.local: got ['head'], but algorithm local keeps every key on its silo",
        ),
        (["model.adapter_dim=-2"], "model.adapter_dim: got -2, expected an integer >= 0"),
        (  # YAML 1.1 reads 010 in octal, 1:30 in base 60, and yes as a boolean
            ["seed=010"],
            "seed: got 010, which YAML reads as 8; write the number in decimal, or quote it "
            "('010') for the text",
        ),
        (["seed=1:30"], "seed: got 1:30, which YAML reads as 90; write the number in decimal"),
        (
            ["name=yes"],
            "name: got yes, which YAML reads as true; write true or false, or quote it ('yes') "
            "for the text",
        ),
        (
            ["algorithm.name=apfl", "algorithm.apfl.grid=[[0.5]]"],
            "algorithm.apfl.grid: got [[0.5]], expected a non-empty list of numbers in [0, 1]",
        ),
        (
            ["ray.silo_cpus=0.00001"],
            "ray.silo_cpus: got 1e-05, expected 0, or a finite number of CPUs from 0.0001",
        ),
        (
            ["ray.silo_cpus=inf"],
            "ray.silo_cpus: got inf, expected 0, or a finite number of CPUs from 0.0001",
        ),
        (  # counted on the meta device: nothing is allocated (the old probe took 1.3 GB)
            ["model.hidden=[16384]", "model.adapter_dim=16384"],
            "model: mlp with model.hidden=[16384] and model.adapter_dim=16384 has 537,165,826 "
            "parameters, expected at most 268,435,456 (1 GiB of float32 per copy; every silo "
            "holds several)",
        ),
        (
            ["metrics.linger_s=-1"],
            "metrics.linger_s: got -1.0, expected a number of seconds from 0 to 600",
        ),
        (["metrics.enabled=maybe"], "metrics.enabled: got 'maybe', expected true or false"),
        (["split.local=head"], "split.local: got 'head', expected a list, e.g. [head]"),
        (["model.hidden=5"], "model.hidden: got 5, expected a list, e.g. [5]"),
        (["rounds=null"], "rounds: got null, expected a value"),
        (["data.late_silos={a: 1}"], "data.late_silos: got a mapping, expected a list"),
        (
            ["algorithm.fedper.head_warmup_epochs=[1]"],
            "algorithm.fedper.head_warmup_epochs: got '[1]', expected a value of type integer",
        ),
        (["split.local={a: 1}"], "split.local: got a mapping, expected a list"),
        (
            ["silos.cleveland.node_label=[a]"],
            "silos.cleveland.node_label: got a list, expected a mapping",
        ),
        (["model=[1]"], "model: got a list, expected a mapping"),
        (["train=5"], "train: got 5, expected a mapping"),
        (["silos.cleveland=5"], "silos.cleveland: got 5, expected a mapping"),
        (["rounds={a: 1}"], "rounds: got \"{'a': 1}\", expected a value of type integer"),
        (
            ["silos.cleveland.node_label=a"],
            "silos.cleveland.node_label: got 'a', expected a mapping, e.g. {name: value}",
        ),
        (["algorithm.finetune.trainable=head"], "algorithm.finetune.trainable: got 'head'"),
        (["data.source=mnist"], "data.source: got 'mnist'"),
        (
            ["algorithm.name=moe_heads", "algorithm.moe_heads.experts=100000000"],
            "algorithm.moe_heads.experts: got 100000000, expected 1 to 1024",
        ),
        (
            ["data.source=csv", "data.paths.a=/x.csv", "data.num_classes=1000000000"],
            "data.num_classes: got 1000000000, expected an integer from 2 to 100000",
        ),
        (
            ["algorithm.name=lg_fedavg", "algorithm.lg_fedavg.local_blocks=100"],
            "algorithm.lg_fedavg.local_blocks: lg_fedavg keeps split.local=['first:100']",
        ),
        (["model.name=cnn_small"], "model.name: cnn_small needs image inputs (C, H, W), got (13,)"),
        (["model.name=resnet18"], "model.name: resnet18 needs image inputs (C, H, W), got (13,)"),
        (
            ["data.source=digits", "model.name=cnn_small_bn", "train.batch_size=1"],
            "train.batch_size: got 1, but model cnn_small_bn has BatchNorm, which needs at least 2",
        ),
        (["name=[a]"], "name: got a list, expected a single value"),
        (["model.name=[mlp]"], "model.name: got a list, expected a single value"),
        (
            ["train.torch_threads=100000"],
            "train.torch_threads: got 100000, expected an integer from 1 to 256",
        ),
        (["round.timeout_s=inf"], "round.timeout_s: got inf, expected a number of seconds > 0"),
        (["round.call_timeout_s=1e300"], "round.call_timeout_s: got 1e+300, expected a number"),
        (["data.source=[heart_disease]"], "data.source: got ['heart_disease'], expected one of"),
        (["data.source={a: 1}"], "data.source: got {'a': 1}, expected one of"),
        (["split.local=[head,tail]"], "split.local[1]: got 'tail'"),
        (["eval.selection=best_test"], "eval.selection"),
        (["eval.every=0"], "eval.every: got 0, expected an integer >= 1"),
        (["eval.every=often"], "eval.every"),
        (["data.val_fraction=1.5"], "data.val_fraction"),
        (["data.num_silos=3"], "data.num_silos: not an option of data.source=heart_disease"),
        (
            ["algorithm.name=fedbn"],
            "algorithm.name: fedbn keeps split.local=['batchnorm'] by default, but on model mlp: "
            "rule 'batchnorm' matches no state_dict key",
        ),
        (["split.local=[last:9]"], "split.local[0]: last:9 asks for more blocks than the model"),
        (
            [
                "data.source=csv",
                "data.num_classes=2",
                "data.paths.a=/x.csv",
                "aggregation.secure=true",
            ],
            "aggregation.secure: needs at least 2 silos",
        ),
        (["data.paths.a=/x.csv"], "data.paths: not an option of data.source=heart_disease"),
        (["rounds"], "expected key=value"),
        (
            ["silos.cleveland.node_label.silo=bad/value"],
            "silos.cleveland.node_label.silo: got 'bad/value', expected a label value",
        ),
        (["server.node_label.-silo=x"], "server.node_label: label key '-silo' is not valid"),
        (["server.node_labels.silo=x"], "server.node_labels: unknown key; allowed: node_label"),
        (["ray.placement=everywhere"], "ray.placement: got 'everywhere', expected one of any"),
        (
            ["ray.placement=per_node", "silos.va.node_label.silo=cleveland"],
            "silos.va.node_label: silo=cleveland is also silo cleveland's node; under "
            "ray.placement=per_node each silo needs a node of its own",
        ),
        (
            [
                "ray.placement=per_node",
                "silos.va.node_label.site=x",
                "silos.hungarian.node_label.site=x",
            ],
            "silos.va.node_label: site=x is also silo hungarian's node",
        ),
    ],
)
def test_bad_values_name_the_key(overrides, expected):
    with pytest.raises(ConfigError) as info:
        load_config(JOB, overrides)
    message = str(info.value)
    assert expected in message
    assert "\n" not in message


def test_missing_required_value(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("name: x\ndata:\n  source: heart_disease\nmodel:\n  name: mlp\n")
    with pytest.raises(ConfigError, match="rounds: required value is missing"):
        load_config(job)


def test_missing_or_broken_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(broken)


@pytest.mark.parametrize("debug", [False, True])
def test_cli_bad_config_exits_non_zero_with_one_line(tmp_path, debug):
    args = [
        sys.executable,
        "-m",
        "silo_pfl.cli",
        "run",
        JOB,
        "rounds=0",
        f"output_dir={tmp_path / 'runs'}",
    ]
    proc = subprocess.run(
        args + (["--debug"] if debug else []),
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: rounds: got 0, expected an integer >= 1"
    )
    assert ("Traceback" in proc.stderr) is debug
    assert proc.stdout == ""
    assert not (tmp_path / "runs").exists() and not (tmp_path / "mlflow.db").exists()


def _leaves(schema: type, prefix: str = "") -> set[str]:
    """Every dotted key of a config dataclass, nested dataclasses included."""
    keys = set()
    for f in dataclasses.fields(schema):
        kind = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(kind):
            keys |= _leaves(type(kind), f"{prefix}{f.name}.")
        else:
            keys.add(f"{prefix}{f.name}")
    return keys


def _config_command(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "silo_pfl", "config", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )


def test_config_prints_every_key_with_its_default_and_runs_as_a_job(tmp_path):
    done = _config_command("jobs/heart_disease.yaml", "algorithm.name=fedrep", "rounds=7")
    assert done.returncode == 0 and not done.stderr, done.stderr
    printed = yaml.safe_load(done.stdout)
    leaves = flat(printed)
    assert _leaves(FederationConfig) - {"data", "algorithm", "silos", "plugins"} <= set(leaves)
    assert printed["rounds"] == 7 and printed["algorithm"]["name"] == "fedrep"
    assert printed["algorithm"]["fedrep"]["head_epochs"] == 5  # the algorithm's own defaults
    assert printed["data"]["val_fraction"] == 0.2  # the data source's defaults
    assert printed["split"]["local"] == ["head"]  # the rules in force, not null
    assert printed["round"]["min_silos"] == 4  # every silo, not null
    secure = yaml.safe_load(
        _config_command("jobs/heart_disease.yaml", "aggregation.secure=true").stdout
    )
    assert secure["aggregation"]["secure_threshold"] == secure["round"]["min_silos"] == 3
    assert set(printed["silos"]) == {"cleveland", "hungarian", "switzerland", "va"}
    assert printed["silos"]["va"] == {
        "tracking_uri": None,
        "node_label": None,
        "key_dir": None,
        "identity_key": None,
    }
    again = tmp_path / "resolved.yaml"
    again.write_text(done.stdout)
    assert resolved_config(load_config(again)) == printed


def test_config_refuses_bad_input_in_one_line():
    done = _config_command("jobs/heart_disease.yaml", "train.lrate=0.1")
    assert done.returncode == 2
    assert done.stderr.strip().startswith("error: train.lrate: unknown key; allowed:")
    assert len(done.stderr.strip().splitlines()) == 1 and not done.stdout


def test_settings_only_secure_aggregation_reads_are_named_when_it_is_off(caplog):
    job = "jobs/heart_disease.yaml"
    secure_only = [
        "aggregation.secure_threshold=3",
        "aggregation.secure_graph.neighbors=2",
        "aggregation.clip=1.5",
    ]
    with caplog.at_level("WARNING", logger="silo_pfl.settings"):
        load_config(job, secure_only)
    assert [r.getMessage() for r in caplog.records] == [
        "aggregation.secure is false, so aggregation.secure_threshold, "
        "aggregation.secure_graph.neighbors, aggregation.clip have no effect: the updates reach "
        "the server in the clear; set aggregation.secure=true to mask them"
    ]
    caplog.clear()
    with caplog.at_level("WARNING", logger="silo_pfl.settings"):
        load_config(job, [*secure_only, "aggregation.secure=true"])
        load_config(job, [])
    assert [r.getMessage() for r in caplog.records] == [  # of the graph, not of secure
        "aggregation.secure_graph.neighbors=2: each silo's secrets are shared among its 3 "
        "holders (itself and its peers) and need all of them, so any silo that drops fails the "
        "round; a larger k tolerates dropouts"
    ]


def test_a_secagg_graph_as_large_as_the_full_mesh_is_named(caplog):
    job = "jobs/heart_disease.yaml"  # 4 silos
    secure = ["aggregation.secure=true"]

    def full_mesh_warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if "full mesh" in r.getMessage()]

    for neighbors in (3, 7):
        caplog.clear()
        with caplog.at_level("WARNING", logger="silo_pfl.settings"):
            load_config(job, [*secure, f"aggregation.secure_graph.neighbors={neighbors}"])
        assert full_mesh_warnings() == [
            f"aggregation.secure_graph.neighbors={neighbors}: with 4 silos each silo pairs with "
            "every other, a full mesh as with null; SecAgg+ saves only with fewer than 3"
        ]
    caplog.clear()
    with caplog.at_level("WARNING", logger="silo_pfl.settings"):
        load_config(job, [*secure, "aggregation.secure_graph.neighbors=2"])
        load_config(job, secure)
    assert full_mesh_warnings() == []
    for late, silos in (("[va]", 3), ("[va,switzerland]", 2)):  # no k >= 2 is below a full mesh
        caplog.clear()
        with caplog.at_level("WARNING", logger="silo_pfl.settings"):
            late_silos = f"data.late_silos={late}"
            load_config(job, [*secure, "aggregation.secure_graph.neighbors=2", late_silos])
        assert full_mesh_warnings() == [
            f"aggregation.secure_graph.neighbors=2: with {silos} silos each silo pairs with "
            f"every other, a full mesh as with null; SecAgg+ saves nothing with {silos} silos"
        ]


@pytest.mark.parametrize(
    ("overrides", "lines"),
    [
        (
            ["data.num_silos=5", "aggregation.secure_graph.neighbors=3"],
            [
                "aggregation.secure_graph.neighbors=3 (raised to 4: 3 and 5 are both odd): with 5 "
                "silos each silo pairs with every other, a full mesh as with null; SecAgg+ saves "
                "only with fewer than 3"
            ],
        ),
        (
            ["data.num_silos=7", "aggregation.secure_graph.neighbors=3"],
            [
                "aggregation.secure_graph.neighbors=3: no 3-regular graph of 7 silos exists, so "
                "each silo pairs with 4",
                "aggregation.secure_graph.neighbors=3: each silo's secrets need 4 of its 5 "
                "holders (itself and its peers), so 2 of one silo's peers lost after sharing keys "
                "fail the round, where aggregation.secure_threshold=5 tolerates 2 lost; a larger "
                "k tolerates more",
            ],
        ),
        (
            ["data.num_silos=10", "aggregation.secure_graph.neighbors=2"],
            [
                "aggregation.secure_graph.neighbors=2: each silo's secrets are shared among its 3 "
                "holders (itself and its peers) and need all of them, so any silo that drops "
                "fails the round; a larger k tolerates dropouts"
            ],
        ),
        (
            ["data.num_silos=10", "aggregation.secure_graph.neighbors=5"],
            [
                "aggregation.secure_graph.neighbors=5: each silo's secrets need 5 of its 6 "
                "holders (itself and its peers), so 2 of one silo's peers lost after sharing keys "
                "fail the round, where aggregation.secure_threshold=7 tolerates 3 lost; a larger "
                "k tolerates more"
            ],
        ),
    ],
)
def test_a_secagg_graph_other_than_its_k_says_is_named(caplog, overrides, lines):
    """k and N both odd raise the degree (at 5 silos, to a full mesh); with 10 silos and k = 2,
    every secret needs its 3 holders; with k = 5 (and 7 silos with k = 3), two of one silo's
    peers lost fail the round, fewer than the threshold's promise."""
    with caplog.at_level("WARNING", logger="silo_pfl.settings"):
        load_config("jobs/digits_label_skew.yaml", ["aggregation.secure=true", *overrides])
    assert [r.getMessage() for r in caplog.records if "secure_graph" in r.getMessage()] == lines


def test_a_loaded_config_handed_to_the_python_api_warns_once(caplog):
    """`silo-pfl run` loads the config, then hands it to Federation, which checks a config
    again only if it was changed since it was checked: the warnings came twice."""
    from silo_pfl.federation import Federation

    secagg = ["aggregation.secure=true", "aggregation.secure_graph.neighbors=3"]
    with caplog.at_level("WARNING", logger="silo_pfl.settings"):
        cfg = load_config("jobs/heart_disease.yaml", secagg)
        Federation(cfg)
    assert len([r for r in caplog.records if "full mesh" in r.getMessage()]) == 1
    cfg.rounds = 0  # changed after its check: checked again
    with pytest.raises(ConfigError, match="rounds: got 0"):
        Federation(cfg)


def test_the_protocol_refuses_a_threshold_that_is_no_majority_however_it_is_built():
    """A silo's process checks its whole config again (`Silo` loads it); the protocol's own
    parameters check the threshold too, so that no path to a silo's client (a plugin, a test,
    a config changed on its way) shares keys with a threshold that is no majority: with 1 of 4,
    a coordinator could recover both of a silo's secrets."""
    from silo_pfl.secure.params import SecureParams

    silos = ("a", "b", "c", "d")
    for threshold in (1, 2, 5):
        with pytest.raises(ConfigError, match=f"secure_threshold: got {threshold}, expected 3"):
            SecureParams("f", silos, threshold=threshold)
    with pytest.raises(ConfigError, match="secure_graph.neighbors: got 1, expected >= 2"):
        SecureParams("f", silos, threshold=3, neighbors=1)
    assert SecureParams("f", silos, threshold=3, neighbors=2).threshold == 3


def test_a_clip_no_silo_could_encode_is_refused():
    with pytest.raises(ConfigError, match=r"aggregation.clip: got inf, but a clipped value times"):
        load_config(JOB, ["aggregation.secure=true", "aggregation.clip=inf"])
    assert load_config(JOB, ["aggregation.secure=true", "aggregation.clip=10"])
    with pytest.raises(ConfigError, match=r"^aggregation.clip: got 1e-300, below the fixed point"):
        load_config(JOB, ["aggregation.secure=true", "aggregation.clip=1e-300"])
    assert load_config(JOB, ["aggregation.secure=true", "aggregation.clip=1e-7"])


def test_a_keyed_config_error_survives_pickling_as_an_actors_error_does():
    import pickle

    from silo_pfl.config_errors import KeyedError

    with pytest.raises(KeyedError) as info:
        load_config(JOB, ["split.local={a: 1}"])
    again = pickle.loads(pickle.dumps(info.value))
    assert (again.key, again.reason, str(again)) == (
        "split.local",
        "got a mapping, expected a list",
        "split.local: got a mapping, expected a list",
    )


def test_an_override_may_still_name_another_key():
    """The check of how YAML reads an override's value leaves interpolations to the merge."""
    cfg = load_config(JOB, ["rounds=4", "eval.every=${rounds}", "seed=1_000"])
    assert (cfg.eval.every, cfg.seed) == (4, 1000)
