"""Settings a job gives that its other settings make do nothing (silo_pfl.unused_settings): one
warning line each, only for keys the user wrote, never for a resolved config's copy."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from silo_pfl import Federation
from silo_pfl.builtin_names import ALGORITHMS  # the built-in ones: plugins come and go
from silo_pfl.config import read_yaml, to_dict
from silo_pfl.settings import from_dict, load_config

JOB = "jobs/heart_disease.yaml"  # mlp, sgd with momentum, FedPer, MLflow on, no secure aggregation
REPO = Path(__file__).resolve().parents[1]


def warnings_of(caplog, load) -> list[str]:
    caplog.clear()
    with caplog.at_level("WARNING", logger="silo_pfl.settings"):
        load()
    return [r.getMessage() for r in caplog.records if r.name == "silo_pfl.settings"]


CASES = [
    (
        ["algorithm.name=local", "server.optimizer=adam", "server.lr=0.1"],
        "split.local=['all'] keeps every key on its silo (algorithm local), so server.optimizer, "
        "server.lr have no effect: there is nothing to aggregate",
    ),
    (
        ["algorithm.name=local", "aggregation.secure=true", "server.lr=0.2"],
        "split.local=['all'] keeps every key on its silo (algorithm local), so server.lr "
        "has no effect: there is nothing to aggregate",  # secure still masks the row counts
    ),
    (
        ["server.beta1=0.5"],
        "server.optimizer is sgd, so server.beta1 has no effect: only momentum, adam, yogi and "
        "adagrad read it",
    ),
    (
        ["server.optimizer=momentum", "server.tau=0.01"],
        "server.optimizer is momentum, so server.tau has no effect: only adam, yogi and adagrad "
        "read it",
    ),
    (
        ["server.optimizer=adagrad", "server.beta2=0.9"],
        "server.optimizer is adagrad, so server.beta2 has no effect: only adam and yogi read it",
    ),
    (
        ["train.optimizer=adam"],  # the job's own train.momentum: 0.9
        "train.optimizer is adam, so train.momentum has no effect: only sgd reads it",
    ),
    (
        ["model.name=cnn_small", "model.hidden=[64]", "data.source=digits"],
        "model.name is cnn_small, so model.hidden has no effect: only mlp and transformer read it",
    ),
    (
        ["ray.address=127.0.0.1:6999", "ray.num_cpus=2", "metrics.linger_s=1"],
        "ray.address is 127.0.0.1:6999, so ray.num_cpus, metrics.linger_s have no effect: only a "
        "local Ray reads them; a cluster keeps the CPUs and export interval its nodes were started "
        "with",
    ),
    (
        ["metrics.enabled=false", "metrics.export_interval_s=2"],
        "metrics.enabled is false, so metrics.export_interval_s has no effect: no live metrics are "
        "exported",
    ),
    (
        ["tracking.enabled=false", "tracking.uri=sqlite:///elsewhere.db", "tracking.report=false"],
        "tracking.enabled is false, so tracking.uri, tracking.report have no effect: nothing is "
        "recorded in MLflow",
    ),
    (
        ["algorithm.name=fedavg", "algorithm.fedprox.mu=0.1"],
        "algorithm.name is fedavg, so algorithm.fedprox.mu has no effect: only algorithm.fedavg.* "
        "is read",
    ),
    (
        ["algorithm.name=perfedavg", "algorithm.perfedavg.hf_delta=0.01"],
        "algorithm.perfedavg.variant is fo, so algorithm.perfedavg.hf_delta has no effect: only "
        "variant=hf reads it",
    ),
    (
        [
            "algorithm.name=perfedavg",
            "algorithm.perfedavg.variant=hf",
            "algorithm.perfedavg.inner_lr=0",
        ],
        "algorithm.perfedavg.inner_lr is 0, so algorithm.perfedavg.variant has no effect: there is "
        "no inner step, and the training and the model are FedAvg's",
    ),
    (
        ["algorithm.name=apfl", "algorithm.apfl.alpha_lr=0.1"],
        "algorithm.apfl.alpha is grid, so algorithm.apfl.alpha_lr has no effect: only "
        "alpha=learned reads it",
    ),
    (
        ["algorithm.name=apfl", "algorithm.apfl.alpha_init=0.2", "algorithm.apfl.alpha=0.3"],
        "algorithm.apfl.alpha is 0.3, so algorithm.apfl.alpha_init has no effect: only "
        "alpha=grid or alpha=learned reads it",
    ),
    (
        ["silos.cleveland.key_dir=/tmp/keys"],
        "aggregation.secure is false, so silos.cleveland.key_dir has no effect: the updates reach "
        "the server in the clear; set aggregation.secure=true to mask them",
    ),
    (
        ["ray.placement=per_node", "ray.silos_per_worker=3"],
        "ray.placement is per_node, so ray.silos_per_worker has no effect: each silo has a worker "
        "of its own, on its own node",
    ),
    (
        ["algorithm.name=fedrep", "train.local_epochs=7"],
        "algorithm.name is fedrep, so train.local_epochs has no effect: a round trains "
        "algorithm.fedrep.head_epochs, then algorithm.fedrep.body_epochs (only an onboarding's "
        "alone baseline reads it)",
    ),
    (
        ["algorithm.name=lg_fedavg", "algorithm.lg_fedavg.local_blocks=2", "split.local=[head]"],
        "split.local is ['head'], so algorithm.lg_fedavg.local_blocks has no effect: split.local "
        "replaces the split it would make",
    ),
    (
        [
            "algorithm.name=moe_heads",
            "algorithm.moe_heads.experts=1",
            "algorithm.moe_heads.class_bias=3",
        ],
        "algorithm.moe_heads.experts is 1, so algorithm.moe_heads.class_bias has no effect: a "
        "single expert is given no class bias",
    ),
    (
        [
            "algorithm.name=finetune",
            "algorithm.finetune.epochs=0",
            "algorithm.finetune.trainable=local",
        ],
        "algorithm.finetune.epochs is 0, so algorithm.finetune.trainable has no effect: no "
        "fine-tuning runs",
    ),
    (
        ["aggregation.max_extra_norm=2"],
        "algorithm.name is fedper, so aggregation.max_extra_norm has no effect: its updates "
        "carry nothing beside the delta (SCAFFOLD's carry their c change)",
    ),
]


@pytest.mark.parametrize(("overrides", "line"), CASES, ids=[c[0][-1] for c in CASES])
def test_a_setting_that_does_nothing_is_named_in_one_line(caplog, overrides, line):
    assert warnings_of(caplog, lambda: load_config(JOB, overrides)) == [line]


@pytest.mark.parametrize(("overrides", "line"), CASES, ids=[c[0][-1] for c in CASES])
def test_a_resolved_copy_of_the_config_warns_of_nothing(caplog, overrides, line):
    """Actors and onboarding rebuild the config from `to_dict`, where every key is present."""
    cfg = load_config(JOB, overrides)
    assert warnings_of(caplog, lambda: from_dict(to_dict(cfg))) == []


@pytest.mark.parametrize("job", sorted(str(p.relative_to(REPO)) for p in REPO.glob("jobs/*.yaml")))
def test_silo_pfl_configs_output_run_as_a_job_warns_of_nothing(caplog, job, tmp_path):
    """`silo-pfl config` writes every key with the value in force, defaults included; run as a
    job, that gives the same run, and no warning for the defaults it wrote out."""
    from omegaconf import OmegaConf

    from silo_pfl.settings import resolved_config

    written = tmp_path / "resolved.yaml"
    written.write_text(OmegaConf.to_yaml(resolved_config(load_config(job))))
    assert warnings_of(caplog, lambda: load_config(str(written))) == []
    chosen = ["train.optimizer=adam", "train.momentum=0.5"]  # not the default: still named
    assert warnings_of(caplog, lambda: load_config(str(written), chosen)) == [
        "train.optimizer is adam, so train.momentum has no effect: only sgd reads it"
    ]


def test_the_config_of_a_job_without_tracking_written_out_warns_of_nothing(caplog, tmp_path):
    """tracking.uri is resolved at load; with tracking off it was written out as a choice, and
    the written config warned that it has no effect."""
    from omegaconf import OmegaConf

    from silo_pfl.settings import resolved_config

    written = tmp_path / "resolved.yaml"
    cfg = load_config(JOB, ["tracking.enabled=false"])
    written.write_text(OmegaConf.to_yaml(resolved_config(cfg)))
    assert warnings_of(caplog, lambda: load_config(str(written))) == []
    assert load_config(str(written)).tracking == cfg.tracking
    team = f"sqlite:///{tmp_path / 'team.db'}"  # written by the user: kept, for tracking on again
    cfg = load_config(JOB, ["tracking.enabled=false", f"tracking.uri={team}"])
    written.write_text(OmegaConf.to_yaml(resolved_config(cfg)))
    assert load_config(str(written), ["tracking.enabled=true"]).tracking.uri == team


def test_a_job_with_its_own_store_is_written_out_whatever_mlflow_tracking_uri_says(monkeypatch):
    """A job that writes tracking.uri never reads $MLFLOW_TRACKING_URI; nor does its config."""
    from silo_pfl.settings import resolved_config

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "file:///tmp/mlruns")  # a store no run may use
    team = "sqlite:////tmp/team.db"
    cfg = load_config(JOB, ["tracking.enabled=false", f"tracking.uri={team}"])
    assert resolved_config(cfg)["tracking"]["uri"] == team


@pytest.mark.parametrize("name", ["apfl", "perfedavg"])
def test_an_algorithms_own_defaults_written_out_warn_of_nothing(caplog, name, tmp_path):
    """`silo-pfl config` writes the chosen algorithm's every option (APFL's alpha_lr beside
    alpha=grid, Per-FedAvg's hf_delta beside variant=fo): at their defaults they are no choice."""
    from omegaconf import OmegaConf

    from silo_pfl.settings import resolved_config

    written = tmp_path / "resolved.yaml"
    cfg = load_config(JOB, [f"algorithm.name={name}"])
    written.write_text(OmegaConf.to_yaml(resolved_config(cfg)))
    assert warnings_of(caplog, lambda: load_config(str(written))) == []


@pytest.mark.parametrize("job", sorted(str(p.relative_to(REPO)) for p in REPO.glob("jobs/*.yaml")))
def test_the_shipped_jobs_warn_of_nothing(caplog, job):
    assert warnings_of(caplog, lambda: load_config(job)) == []


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_switching_algorithm_keeps_the_jobs_own_sections_quiet(caplog, name):
    """digits_label_skew.yaml has an algorithm.fedper section; algorithm.name=<other> on it is how
    jobs are compared, not a mistake."""
    job, overrides = "jobs/digits_label_skew.yaml", ["model.name=cnn_small_bn"]
    load = lambda: load_config(job, [*overrides, f"algorithm.name={name}"])  # noqa: E731
    assert warnings_of(caplog, load) == []


def test_a_setting_given_null_is_not_named(caplog):
    assert warnings_of(caplog, lambda: load_config(JOB, ["aggregation.clip=null"])) == []


def test_the_python_api_warns_for_a_mapping_and_for_overrides(caplog):
    base = dict(read_yaml(Path(JOB)))
    line = "train.optimizer is adam, so train.momentum has no effect: only sgd reads it"
    assert warnings_of(caplog, lambda: Federation(base, ["train.optimizer=adam"])) == [line]
    cfg = load_config(JOB)
    assert warnings_of(caplog, lambda: Federation(cfg, ["server.beta1=0.5"])) == [
        "server.optimizer is sgd, so server.beta1 has no effect: only momentum, adam, yogi and "
        "adagrad read it"
    ]
    assert (
        warnings_of(
            caplog, lambda: Federation(base, ["algorithm.name=fedavgm", "server.beta1=0.5"])
        )
        == []
    )


def test_the_cli_prints_the_line_on_stderr_and_goes_on():
    command = [sys.executable, "-m", "silo_pfl", "config", JOB, "train.optimizer=adam"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip() == (
        "train.optimizer is adam, so train.momentum has no effect: only sgd reads it"
    )
    assert "optimizer: adam" in done.stdout


def test_a_job_that_chooses_fedrep_and_sets_local_epochs_is_told_in_one_line(caplog, tmp_path):
    """Switched to fedrep by an override, the job's own train.local_epochs is quiet (jobs are
    compared so); a job that itself chooses fedrep is told its local_epochs do nothing."""
    job = tmp_path / "fedrep.yaml"
    job.write_text(Path(JOB).read_text().replace("name: fedper", "name: fedrep"))
    assert "name: fedrep" in job.read_text()
    assert warnings_of(caplog, lambda: load_config(str(job))) == [
        "algorithm.name is fedrep, so train.local_epochs has no effect: a round trains "
        "algorithm.fedrep.head_epochs, then algorithm.fedrep.body_epochs (only an onboarding's "
        "alone baseline reads it)"
    ]
    assert warnings_of(caplog, lambda: load_config(JOB, ["algorithm.name=fedrep"])) == []
