"""Federations submitted as Ray Jobs to a real multi-node cluster on loopback.

The cluster is the shared one of tests/loopback_cluster.py (the project's own
`cluster/local_cluster.py`, started with `ray start`): a head and a node per hospital labelled
silo=<name>, token authentication on, and an MLflow tracking server (--serve-artifacts) beside
it. Each hospital's rows exist only in the directory its node names as $SILO_PFL_DATA_DIR;
neither the head (where the job's driver runs) nor this test process has that variable. The job
federates two of the hospitals.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import yaml
from drivers import joining_env, start_driver
from processes import stop_group
from serving import predict, served

from silo_pfl.data import csv_source
from silo_pfl.settings import load_config

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
JOB = "jobs/hospitals_on_nodes.yaml"
SILOS = ("cleveland", "hungarian")
BIN = Path(sys.executable).parent


@pytest.fixture
def cluster(loopback_cluster):
    """The shared cluster: info, the env its clients need, and the base of its data."""
    return loopback_cluster


def _silo_pfl(*args: str) -> list[str]:
    return [sys.executable, "-m", "silo_pfl", *args]


def _cli(env: dict[str, str], *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        _silo_pfl(*args),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


class Started:
    """A command started now, with its output piped; `done()` waits for it, once."""

    def __init__(self, command: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            command,
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self._done: subprocess.CompletedProcess | None = None

    def done(self, timeout: float = 600) -> subprocess.CompletedProcess:
        if self._done is None:
            try:
                out, err = self.proc.communicate(timeout=timeout)
            finally:
                stop_group(self.proc)
            self._done = subprocess.CompletedProcess(self.proc.args, self.proc.returncode, out, err)
        return self._done


def _client(uri: str):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def _assert_tracked_on_nodes(uri: str, name: str, nodes: dict[str, str]) -> str:
    """Each silo's child run says it ran on its node, and its model is registered as champion.

    Returns the parent run's id."""
    client = _client(uri)
    experiment = client.get_experiment_by_name(name)
    assert experiment is not None
    runs = client.search_runs([experiment.experiment_id])
    children = {r.data.tags["silo"]: r for r in runs if "silo" in r.data.tags}
    assert {s: r.data.tags["node_id"] for s, r in children.items()} == nodes
    for silo in SILOS:
        version = client.get_model_version_by_alias(f"{name}-{silo}", "champion")
        assert version.tags["silo"] == silo
    (parent,) = [r for r in runs if "silo" not in r.data.tags]
    return parent.info.run_id


def _serve_and_score(tmp_path: Path, uri: str, model: str, silo: str, rows_file: Path) -> float:
    """Accuracy of `mlflow models serve` of `model` on the silo's held-out test rows."""
    cfg = load_config(JOB, [f"data.paths.{silo}={rows_file}"])
    data = csv_source.load(cfg.data, silo, cfg.seed)
    with served(model, uri, tmp_path / "serve.log") as url:
        predictions = predict(url, data.raw_columns, data.x_test_raw.tolist())
    return float(np.mean(predictions == data.y_test))


def _team_plugin(base: Path) -> None:
    """A plugin package under `base`, importable there alone: team_algos.mine's team_fedavg."""
    package = base / "team_algos"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "mine.py").write_text(
        "from silo_pfl.algorithms import register\n"
        "from silo_pfl.algorithms.fedavg import FedAvg\n\n\n"
        "@register\nclass TeamFedAvg(FedAvg):\n    name = 'team_fedavg'\n"
    )


@pytest.fixture(scope="module")
def at_once(loopback_cluster, tmp_path_factory) -> dict[str, SimpleNamespace]:
    """The module's submissions that wait on no other, started together: the cluster runs them
    side by side, as it runs several teams' jobs, and the module waits for the longest of them
    rather than their sum. Each: its Started command and the files its test reads.

    - submitted: jobs/hospitals_on_nodes.yaml as federation jobs_submit, tracked in the
      cluster's store, its run directory where every node finds it (an absolute output_dir);
    - plugin: a job whose algorithm is a plugin importable only where it is submitted;
    - failing: a job valid where it is submitted, which no node of the cluster can place;
    - plain: `ray job submit --working-dir .`, as the README shows, the server on a worker;
    - one_node: a run joined to the cluster whose two silos' labels pick one node."""
    cluster, uri = loopback_cluster, loopback_cluster.info["tracking_uri"]
    address = ["--address", cluster.info["dashboard"]]
    base = tmp_path_factory.mktemp("at_once")
    jobs: dict[str, SimpleNamespace] = {}

    results, runs = base / "results.json", f"output_dir={base / 'runs'}"
    args = ["submit", JOB, "rounds=2", "name=jobs_submit", f"tracking.uri={uri}", runs]
    args += [*address, "--results", str(results), "--quiet"]
    jobs["submitted"] = SimpleNamespace(
        started=Started(_silo_pfl(*args), cluster.env), results=results, runs=runs
    )

    _team_plugin(base)
    plugin_results = base / "plugin.json"
    args = ["submit", JOB, "plugins=[team_algos.mine]", "algorithm.name=team_fedavg", "rounds=1"]
    args += ["tracking.enabled=false", "--quiet", "--results", str(plugin_results), *address]
    env = {**cluster.env, "PYTHONPATH": str(base)}
    jobs["plugin"] = SimpleNamespace(started=Started(_silo_pfl(*args), env), results=plugin_results)

    args = ["submit", JOB, "silos.hungarian.node_label.silo=nowhere", "tracking.enabled=false"]
    jobs["failing"] = SimpleNamespace(
        started=Started(_silo_pfl(*args, "--quiet", *address), cluster.env)
    )

    command = [str(BIN / "ray"), "job", "submit", *address]
    command += ["--working-dir", ".", "--", "python", "-m", "silo_pfl", "run", JOB]
    command += ["rounds=2", "name=jobs_plain", f"tracking.uri={uri}"]
    command += ["server.node_label.silo=hungarian", "--results-in-log"]
    jobs["plain"] = SimpleNamespace(started=Started(command, cluster.env))

    one_node = base / "one_node"
    one_node.mkdir()
    job = yaml.safe_load((ROOT / JOB).read_text())
    job["silos"] = {
        "hungarian": {"node_label": {"ray.io/node-id": cluster.info["nodes"]["cleveland"]}}
    }
    (one_node / "job.yaml").write_text(yaml.safe_dump(job))
    store = f"sqlite:///{one_node / 'mlflow.db'}"
    args = ["run", str(one_node / "job.yaml"), f"ray.address={cluster.info['address']}"]
    args += [f"tracking.uri={store}", f"output_dir={one_node}"]
    jobs["one_node"] = SimpleNamespace(started=Started(_silo_pfl(*args), cluster.env), uri=store)
    try:
        yield jobs
    finally:
        for job in jobs.values():
            stop_group(job.started.proc)


@pytest.fixture(scope="module")
def submitted(at_once) -> SimpleNamespace:
    """at_once's federation jobs_submit, ended: the command's output, the run's results and its
    output_dir override."""
    job = at_once["submitted"]
    return SimpleNamespace(done=job.started.done(), results=job.results, runs=job.runs)


def test_silo_pfl_submit_places_each_silo_on_its_node_and_registers_its_model(
    cluster, submitted, tmp_path
):
    uri, done, results = cluster.info["tracking_uri"], submitted.done, submitted.results
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "SUCCEEDED" in done.stdout.splitlines()[-1]
    assert "mean test accuracy" in done.stdout and "round 1/2" not in done.stdout  # --quiet
    # The job's YAML went to its driver alone, in the entrypoint: no working_dir, which Ray
    # unpacks on every node that runs a worker of the job, each institution's among them.
    from ray.job_submission import JobSubmissionClient

    job_id = done.stdout.split("submitted job ")[1].split()[0]
    token = {"Authorization": f"Bearer {cluster.env['RAY_AUTH_TOKEN']}"}
    job = JobSubmissionClient(cluster.info["dashboard"], headers=token).get_job_info(job_id)
    assert "working_dir" not in (job.runtime_env or {}), job.runtime_env
    assert " run base64:" in job.entrypoint and "cleveland" not in job.entrypoint
    summary = json.loads(results.read_text())
    nodes = {s: cluster.info["nodes"][s] for s in SILOS}
    assert {s: summary["silos"][s]["node_id"] for s in SILOS} == nodes
    assert summary["server_node_id"] == cluster.info["head"]
    _assert_tracked_on_nodes(uri, "jobs_submit", nodes)
    rows = cluster.base / "nodes" / "cleveland" / "heart.csv"
    model = summary["mlflow"]["models"]["cleveland"]
    accuracy = _serve_and_score(tmp_path, uri, model, "cleveland", rows)
    assert accuracy == pytest.approx(summary["silos"]["cleveland"]["test_accuracy"], abs=0.005)


def test_a_silo_joins_a_submitted_federation_on_its_own_node_as_a_job(cluster, submitted, tmp_path):
    """`silo-pfl submit --onboard switzerland`: the cold start as a Ray Job. The onboarding runs
    on switzerland's node, on the rows only that node has, and registers its model beside the
    founders' (the federation `submitted` trained and registered)."""
    assert submitted.done.returncode == 0, submitted.done.stderr[-3000:]
    uri, results = cluster.info["tracking_uri"], tmp_path / "joined.json"
    joining = ["data.late_silos=[switzerland]"]
    joining += ["data.paths.switzerland=$SILO_PFL_DATA_DIR/heart.csv"]
    args = ["--onboard", "switzerland", "--no-alone", "name=jobs_submit", "rounds=2"]
    args += [f"tracking.uri={uri}"]
    args += [*joining, "--quiet", "--address", cluster.info["dashboard"], "--results", str(results)]
    done = _cli(cluster.env, "submit", JOB, *args)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "switzerland joined run " in done.stdout
    summary = json.loads(results.read_text())
    assert list(summary["silos"]) == ["switzerland"]
    assert summary["silos"]["switzerland"]["node_id"] == cluster.info["nodes"]["switzerland"]
    assert "alone_test_accuracy" not in summary["onboard"]  # --no-alone reached the driver
    version = _client(uri).get_model_version_by_alias("jobs_submit-switzerland", "champion")
    assert version.tags["joined"] == "onboard"


def test_a_submitted_run_is_resumed_by_a_later_submission(cluster, submitted, tmp_path):
    """`silo-pfl submit --resume`: a later job continues the tracked run `submitted` made, from
    its last round, in the directory an absolute output_dir gives it on every node, and in the
    same MLflow run."""
    assert submitted.done.returncode == 0, submitted.done.stderr[-3000:]
    assert "output_dir" not in submitted.done.stderr
    second = tmp_path / "second.json"
    again = ["--resume", "rounds=3", submitted.runs, "--results", str(second), "--quiet"]
    again += ["name=jobs_submit", f"tracking.uri={cluster.info['tracking_uri']}"]
    done = _cli(cluster.env, "submit", JOB, *again, "--address", cluster.info["dashboard"])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    a, b = json.loads(submitted.results.read_text()), json.loads(second.read_text())
    assert b["run_id"] == a["run_id"] and b["rounds"] == 3
    assert b["mlflow"]["run_id"] == a["mlflow"]["run_id"]
    assert [h["round"] for h in b["history"]] == [1, 2, 3]
    assert b["history"][:2] == a["history"]


def test_submit_ships_a_plugin_the_nodes_do_not_have(at_once):
    """A plugin importable where the job is submitted (here through PYTHONPATH) is shipped with
    it: the driver and every silo's node import it, and its algorithm runs."""
    done = at_once["plugin"].started.done()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert json.loads(at_once["plugin"].results.read_text())["algorithm"] == "team_fedavg"


def test_plain_ray_job_submit_with_the_server_on_a_worker_node(cluster, at_once):
    """`ray job submit --working-dir .`, as the README shows; the server pinned to a worker."""
    uri = cluster.info["tracking_uri"]
    done = at_once["plain"].started.done()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    marker = "silo-pfl-results: "
    (line,) = [x for x in done.stdout.splitlines() if x.startswith(marker)]
    summary = json.loads(line[len(marker) :])
    nodes = {s: cluster.info["nodes"][s] for s in SILOS}
    assert {s: summary["silos"][s]["node_id"] for s in SILOS} == nodes
    assert summary["server_node_id"] == cluster.info["nodes"]["hungarian"]
    parent = _assert_tracked_on_nodes(uri, "jobs_plain", nodes)
    artifacts = [a.path for a in _client(uri).list_artifacts(parent, "global_model")]
    assert artifacts == ["global_model/global_state.npz"]


def _runs(uri: str, name: str) -> list:
    client = _client(uri)
    experiment = client.get_experiment_by_name(name)
    return client.search_runs([experiment.experiment_id]) if experiment else []


def test_jobs_lists_a_submission_and_stop_ends_it_as_killed(cluster):
    """Ctrl-C leaves `silo-pfl submit` at once and the job going on, with the command that stops
    it; that command, run as printed, sends the job's driver SIGTERM: it stops, and its MLflow
    runs say KILLED."""
    uri, address = cluster.info["tracking_uri"], ["--address", cluster.info["dashboard"]]
    args = ("submit", JOB, "rounds=5000", "name=jobs_stop", f"tracking.uri={uri}", *address)
    as_a_terminal = {"preexec_fn": lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)}
    submit = start_driver(list(args), cluster.env, **as_a_terminal)
    try:
        assert submit.stdout is not None
        job_id = submit.stdout.readline().split("submitted job ")[1].split()[0]
        listed = _cli(cluster.env, "jobs", *address)
        assert listed.returncode == 0, listed.stderr
        (row,) = [x for x in listed.stdout.splitlines() if x.startswith(job_id)]
        assert "jobs_stop" in row
        deadline = time.monotonic() + 120
        while len(_runs(uri, "jobs_stop")) < 1 + len(SILOS):  # the rounds have begun
            assert time.monotonic() < deadline, "the job's MLflow runs never appeared"
            time.sleep(1)
        submit.send_signal(signal.SIGINT)
        _, err = submit.communicate(timeout=60)
    finally:
        stop_group(submit)
    assert submit.returncode == 130, err
    hint = f"job {job_id} goes on; stop it with: "
    (line,) = [x for x in err.splitlines() if x.startswith(hint)]
    command = shlex.split(line.removeprefix(hint))
    assert command == ["silo-pfl", "stop", job_id, *address], command
    stopped = _cli(cluster.env, *command[1:])
    assert stopped.returncode == 0 and "stopping" in stopped.stdout, stopped.stderr
    deadline = time.monotonic() + 60
    while "STOPPED" not in row or {r.info.status for r in _runs(uri, "jobs_stop")} != {"KILLED"}:
        assert time.monotonic() < deadline, (row, [r.info.status for r in _runs(uri, "jobs_stop")])
        time.sleep(1)
        listed = _cli(cluster.env, "jobs", *address)
        (row,) = [x for x in listed.stdout.splitlines() if x.startswith(job_id)]


def test_a_job_that_fails_on_the_cluster_exits_1_naming_its_status_and_reason(at_once):
    """The config is valid where it is submitted; on the cluster no node has the label."""
    done = at_once["failing"].started.done()
    assert done.returncode == 1, done.stdout[-2000:]
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("error: job silo-pfl-hospitals_on_nodes-") and " FAILED: " in line
    assert "silo hungarian: no live Ray node carries the label silo=nowhere" in line, line


def test_a_submission_without_the_token_is_refused_in_one_line(cluster, tmp_path):
    env = {k: v for k, v in cluster.env.items() if k != "RAY_AUTH_TOKEN"}
    env["HOME"] = str(tmp_path)  # no ~/.ray/auth_token either
    address = ["--address", cluster.info["dashboard"]]
    done = _cli(env, "submit", JOB, "tracking.enabled=false", *address)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(
        f"error: --address {cluster.info['dashboard']}: the cluster refused the request, sent "
        "with no token ("
    )
    assert "RAY_AUTH_TOKEN" in line
    # A token file given on purpose wins over another cluster's token in the environment.
    (tmp_path / "token").write_text(cluster.env["RAY_AUTH_TOKEN"])
    listed = _cli({**env, "RAY_AUTH_TOKEN": "another-clusters"}, "jobs", *address)
    assert listed.returncode == 1 and "refused the request, sent with RAY_AUTH_TOKEN (" in (
        listed.stderr
    ), listed.stderr
    listed = _cli(
        {**env, "RAY_AUTH_TOKEN": "another-clusters"},
        "jobs",
        *address,
        "--token-file",
        str(tmp_path / "token"),
    )
    assert listed.returncode == 0 and listed.stdout.startswith("job id"), listed.stderr


def test_a_silo_pinned_to_a_label_no_node_has_fails_within_30_seconds(cluster, tmp_path):
    began = time.monotonic()
    done = _cli(
        cluster.env,
        "run",
        JOB,
        f"ray.address={cluster.info['address']}",
        "silos.cleveland.node_label.silo=nowhere",
        "tracking.enabled=false",
        f"output_dir={tmp_path}",
        timeout=120,
    )
    elapsed = time.monotonic() - began
    assert done.returncode == 1
    assert elapsed < 30, elapsed
    assert "Traceback" not in done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert "silo cleveland" in line and "silo=nowhere" in line, line


def test_two_silos_on_one_node_under_per_node_fail_before_training(at_once):
    """hungarian pinned by a label cleveland's node carries too (its node id): the second silo
    would read cleveland's data and register a model of it as hungarian's. One line names both
    silos once their set-up shows one node, before any round; nothing is registered."""
    done, uri = at_once["one_node"].started.done(), at_once["one_node"].uri
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("error: silos cleveland and hungarian: both run on node "), line
    assert "each silo needs a node of its own" in line and "round 1" not in done.stdout
    assert not _client(uri).search_registered_models()


def test_the_data_path_exists_only_on_the_silos_own_node(ray_local, tmp_path):
    """Off the silo's node (here: the session's local Ray, no $SILO_PFL_DATA_DIR) the file cannot
    be found. A run that joins a cluster with its silos left to any node is refused at load; a
    silo that runs where the variable is unset says so, naming it."""
    from silo_pfl.data.csv_source import node_path
    from silo_pfl.errors import DataError

    assert "SILO_PFL_DATA_DIR" not in os.environ  # nor in the local Ray's workers, then
    env = {k: v for k, v in joining_env().items() if k != "SILO_PFL_DATA_DIR"}
    done = _cli(
        env,
        "run",
        JOB,
        "rounds=1",
        "ray.placement=any",
        "tracking.enabled=false",
        f"output_dir={tmp_path}",
    )
    assert done.returncode == 2
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("error: data.paths.cleveland: $SILO_PFL_DATA_DIR/heart.csv names"), line
    assert line.endswith("pin it: ray.placement=per_node, or silos.cleveland.node_label"), line
    with pytest.raises(DataError) as unset:
        node_path("cleveland", "$SILO_PFL_DATA_DIR/heart.csv")
    assert "SILO_PFL_DATA_DIR is not set on the node the silo ran on; set it where its" in str(
        unset.value
    )
    assert "(ray.placement=per_node, or silos.cleveland.node_label)" in str(unset.value)
