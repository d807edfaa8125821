"""The static cluster definitions under cluster/: parsed, validated and exercised without a cluster.

No Ray cluster, no Kubernetes and no network: the on-prem config goes through the same
prepare/validate steps as `ray up` and its start commands run against a stub `ray`; the KubeRay
manifests are checked against a hand-copied list of CRD fields; the shell scripts run with stubs
or with the real openssl.

The KubeRay field allow-lists below were transcribed from the ray.io/v1 CRDs of KubeRay v1.7.0
(tag commit 59d663aeec13760646da3db9c1cf8cfe883e30b7, ray-operator/config/crd/bases/
ray.io_rayclusters.yaml and ray.io_rayjobs.yaml); every path the manifests use is also in the
v1.5.1 CRDs (9e8a2c08) and on master at feeaf72f (authOptions.secretName, allowed but unused, is
KubeRay >= 1.6). KubeRay >= 1.5.0 rejects `labels` inside rayStartParams (validation.go:
"use the top-level Labels field instead"), hence the group `labels` field. The Ray schema is the
installed package's ray/autoscaler/ray-schema.json (Ray 2.60.0).
"""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import shutil
import ssl
import stat
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "cluster"
KUBERAY = CLUSTER / "kuberay"
SILOS = ("cleveland", "hungarian", "switzerland", "va")
YAML_FILES = (
    CLUSTER / "onprem.yaml",
    CLUSTER / "runtime_env.yaml",
    KUBERAY / "raycluster.yaml",
    KUBERAY / "rayjob.yaml",
    KUBERAY / "mlflow.yaml",
)

# ---- KubeRay ray.io/v1 fields used by the manifests, copied by hand from the CRDs (see above).
# "x.*" is a map field (any key, string values); "[]" an array's items.
_CONTAINER = {
    "name",
    "image",
    "env",
    "env[].name",
    "env[].value",
    "ports",
    "ports[].containerPort",
    "ports[].name",
    "resources",
    "resources.limits",
    "resources.limits.*",
    "resources.requests",
    "resources.requests.*",
    "volumeMounts",
    "volumeMounts[].name",
    "volumeMounts[].mountPath",
    "volumeMounts[].readOnly",
}
_POD = {
    "nodeSelector",
    "nodeSelector.*",
    "tolerations",
    "tolerations[].key",
    "tolerations[].operator",
    "tolerations[].value",
    "tolerations[].effect",
    "volumes",
    "volumes[].name",
    "volumes[].hostPath",
    "volumes[].hostPath.path",
    "volumes[].hostPath.type",
    "volumes[].persistentVolumeClaim",
    "volumes[].persistentVolumeClaim.claimName",
    "volumes[].persistentVolumeClaim.readOnly",
    "containers",
    *(f"containers[].{field}" for field in _CONTAINER),
}
_GROUP = {
    "labels",
    "labels.*",
    "rayStartParams",
    "rayStartParams.*",
    "template",
    "template.spec",
    *(f"template.spec.{field}" for field in _POD),
}
RAYCLUSTER_FIELDS = {
    "spec",
    "spec.rayVersion",
    "spec.authOptions",
    "spec.authOptions.mode",
    "spec.authOptions.secretName",
    "spec.headGroupSpec",
    *(f"spec.headGroupSpec.{field}" for field in _GROUP),
    "spec.workerGroupSpecs",
    "spec.workerGroupSpecs[].groupName",
    "spec.workerGroupSpecs[].replicas",
    "spec.workerGroupSpecs[].minReplicas",
    "spec.workerGroupSpecs[].maxReplicas",
    *(f"spec.workerGroupSpecs[].{field}" for field in _GROUP),
}
RAYJOB_FIELDS = {
    "spec",
    "spec.entrypoint",
    "spec.clusterSelector",
    "spec.clusterSelector.*",
    "spec.submissionMode",
    "spec.runtimeEnvYAML",
    "spec.activeDeadlineSeconds",
}
# Fields whose keys are free (label maps, resource quantities): their keys are not field names.
MAP_FIELDS = {"labels", "nodeSelector", "rayStartParams", "limits", "requests", "clusterSelector"}


def field_paths(node: object, prefix: str) -> set[str]:
    """Every field path in a manifest subtree, in the allow-lists' notation."""
    paths: set[str] = set()
    if isinstance(node, dict):
        for key, value in node.items():
            path = f"{prefix}.{key}"
            paths.add(path)
            if key in MAP_FIELDS and isinstance(value, dict):
                paths.update(f"{path}.*" for _ in value)
            else:
                paths |= field_paths(value, path)
    elif isinstance(node, list):
        for item in node:
            paths |= field_paths(item, f"{prefix}[]")
    return paths


def load(path: Path) -> dict:
    with path.open() as handle:
        return yaml.safe_load(handle)


def load_all(path: Path) -> list[dict]:
    with path.open() as handle:
        return [doc for doc in yaml.safe_load_all(handle) if doc is not None]


@pytest.fixture(scope="module")
def onprem() -> dict:
    return load(CLUSTER / "onprem.yaml")


@pytest.fixture(scope="module")
def raycluster() -> dict:
    return load(KUBERAY / "raycluster.yaml")


@pytest.fixture(scope="module")
def rayjob() -> dict:
    return load(KUBERAY / "rayjob.yaml")


@pytest.fixture(scope="module")
def mlflow_docs() -> dict[str, dict]:
    return {doc["kind"]: doc for doc in load_all(KUBERAY / "mlflow.yaml")}


@pytest.mark.parametrize("path", YAML_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_definition_parses(path):
    docs = load_all(path)
    assert docs, f"{path} is empty"
    assert all(isinstance(doc, dict) for doc in docs)


# ---------------------------------------------------------------- on-premise (ray up, local)


def test_onprem_is_a_valid_local_cluster_config(onprem):
    """Valid against ray-schema.json, and through the same prepare/validate steps as `ray up`
    (the local provider aborts on available_node_types and needs head_ip + worker_ips)."""
    import jsonschema
    import ray.autoscaler
    from ray.autoscaler._private.util import prepare_config, validate_config

    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    jsonschema.validate(onprem, schema)
    assert onprem["provider"]["type"] == "local"
    prepared = prepare_config(copy.deepcopy(onprem))
    validate_config(prepared)
    (node_type,) = prepared["available_node_types"].values()
    assert node_type["min_workers"] == node_type["max_workers"] == len(SILOS)


def test_onprem_names_one_machine_per_institution(onprem):
    provider = onprem["provider"]
    institutions = onprem["metadata"]["silo_pfl"]["institutions"]
    assert sorted(institutions) == sorted(SILOS)
    assert sorted(institutions.values()) == sorted(provider["worker_ips"])
    assert len(set(provider["worker_ips"])) == len(SILOS)
    assert provider["head_ip"] not in provider["worker_ips"]
    tracking = urlparse(onprem["metadata"]["silo_pfl"]["tracking_uri"])
    assert tracking.hostname == provider["head_ip"]


def test_onprem_ships_no_file_the_checkout_ignores(onprem):
    """`ray up` copies the checkout to every institution's node; without the filter its
    comparison cache, reports and builds went along."""
    assert ".gitignore" in onprem["rsync_filter"]
    ignored = (ROOT / ".gitignore").read_text().split()
    assert {".compare_cache/", "reports/", "runs/", "mlflow.db"} <= set(ignored)


def test_onprem_sets_up_a_virtual_environment_whose_python_comes_first(onprem, tmp_path):
    """Debian 12 and Ubuntu 24.04 refuse a system-wide pip (PEP 668) and have no `python`, which
    a job's entrypoint runs. The set-up, run twice as `ray up` may, makes an environment of the
    SSH user's own, and the login shell Ray runs each command in finds its python first."""
    *prepare, install = onprem["setup_commands"]
    assert install.startswith("~/silo_pfl_env/bin/pip install")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    for _ in range(2):
        for command in prepare:
            done = subprocess.run(
                ["bash", "-c", command], env=env, capture_output=True, timeout=120
            )
            assert done.returncode == 0, done.stderr
    assert (tmp_path / ".bashrc").read_text().count("silo_pfl_env/bin") == 1
    found = subprocess.run(
        ["bash", "-c", "source ~/.bashrc && command -v python"],
        env=env,
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert found.stdout.strip() == str(tmp_path / "silo_pfl_env" / "bin" / "python")


def test_onprem_never_holds_the_token(onprem):
    text = (CLUSTER / "onprem.yaml").read_text()
    assert "RAY_AUTH_TOKEN=" not in text
    assert onprem["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"


STUB_RAY = """#!{python}
import json, os, sys
keys = ("RAY_AUTH_MODE", "RAY_HEAD_IP", "SILO_PFL_DATA_DIR")
with open(os.environ["STUB_LOG"], "a") as log:
    log.write(json.dumps({{"argv": sys.argv[1:], "env": {{k: os.environ.get(k) for k in keys}}}}))
    log.write("\\n")
"""


def run_start_commands(commands: list[str], tmp_path: Path, node_env: str | None):
    """Run start commands as a node would, with a stub `ray` that records what it is given."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    stub = bin_dir / "ray"
    stub.write_text(STUB_RAY.format(python=sys.executable))
    stub.chmod(0o755)
    log = tmp_path / "ray_calls.jsonl"
    log.write_text("")
    env_file = tmp_path / "node.env"
    if node_env is not None:
        env_file.write_text(node_env)
    env = {
        "PATH": f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin",
        "HOME": str(tmp_path),
        "STUB_LOG": str(log),
        "SILO_PFL_NODE_ENV": str(env_file),
    }
    codes = []
    for command in commands:
        proc = subprocess.run(
            ["bash", "-c", command], env=env, capture_output=True, text=True, timeout=20
        )
        codes.append(proc.returncode)
        if proc.returncode:
            break
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    return codes, calls


def ray_start(calls: list[dict]) -> dict:
    (start,) = [c for c in calls if c["argv"][:1] == ["start"]]
    return start


@pytest.mark.parametrize("silo", SILOS)
def test_onprem_silo_node_starts_labelled_with_token_auth(onprem, tmp_path, silo):
    from ray._private.label_utils import parse_node_labels_string
    from ray.autoscaler._private.util import with_head_node_ip

    head_ip = onprem["provider"]["head_ip"]
    commands = with_head_node_ip(onprem["worker_start_ray_commands"], head_ip)
    # The node's file even tries to switch token auth off: the start command must win.
    node_env = f"SILO_PFL_SILO={silo}\nSILO_PFL_DATA_DIR=/srv/{silo}/data\nRAY_AUTH_MODE=disabled\n"
    codes, calls = run_start_commands(commands, tmp_path, node_env)
    assert codes == [0] * len(commands)
    start = ray_start(calls)
    args = start["argv"]
    assert f"--address={head_ip}:6379" in args
    labels = [a.split("=", 1)[1] for a in args if a.startswith("--labels=")]
    assert len(labels) == 1
    assert parse_node_labels_string(labels[0]) == {"silo": silo}
    assert start["env"]["RAY_AUTH_MODE"] == "token"
    assert start["env"]["SILO_PFL_DATA_DIR"] == f"/srv/{silo}/data"


@pytest.mark.parametrize(
    "node_env", [None, "SILO_PFL_DATA_DIR=/srv/x\n"], ids=["no-file", "no-silo"]
)
def test_onprem_node_without_its_silo_name_never_joins(onprem, tmp_path, node_env):
    from ray.autoscaler._private.util import with_head_node_ip

    commands = with_head_node_ip(onprem["worker_start_ray_commands"], onprem["provider"]["head_ip"])
    codes, calls = run_start_commands(commands, tmp_path, node_env)
    assert codes[-1] != 0
    assert not [c for c in calls if c["argv"][:1] == ["start"]]


def test_onprem_head_has_token_auth_and_a_loopback_dashboard(onprem, tmp_path):
    ray_commands = [c for c in onprem["head_start_ray_commands"] if "tracking_server" not in c]
    codes, calls = run_start_commands(ray_commands, tmp_path, node_env=None)
    assert codes == [0] * len(ray_commands)
    start = ray_start(calls)
    assert "--head" in start["argv"]
    assert "--dashboard-host=127.0.0.1" in start["argv"]
    assert start["env"]["RAY_AUTH_MODE"] == "token"
    assert not any(a.startswith("--labels=silo=") for a in start["argv"])


def test_onprem_head_starts_the_tracking_server(onprem, tmp_path):
    (command,) = [c for c in onprem["head_start_ray_commands"] if "tracking_server.sh" in c]
    script = tmp_path / "silo_pfl" / "cluster" / "tracking_server.sh"
    script.parent.mkdir(parents=True)
    seen = tmp_path / "seen.json"
    partial = tmp_path / "seen.partial"
    # A stand-in for the real script (which `ray up` copies there): it records what it is given.
    script.write_text(
        f'printf \'{{"HOST": "%s", "PORT": "%s"}}\' "$HOST" "$PORT" > {partial}\n'
        f"mv {partial} {seen}\n"
    )
    env = {"PATH": f"/usr/bin{os.pathsep}/bin", "HOME": str(tmp_path)}
    subprocess.run(["bash", "-c", command], env=env, check=True, timeout=20)
    deadline = time.monotonic() + 10
    while not seen.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    tracking = urlparse(onprem["metadata"]["silo_pfl"]["tracking_uri"])
    assert json.loads(seen.read_text()) == {"HOST": tracking.hostname, "PORT": str(tracking.port)}
    assert (tmp_path / "silo_pfl_mlflow" / "server.pid").read_text().strip().isdigit()


# ---------------------------------------------------------------- KubeRay


def test_kuberay_kinds(raycluster, rayjob, mlflow_docs):
    assert (raycluster["apiVersion"], raycluster["kind"]) == ("ray.io/v1", "RayCluster")
    assert (rayjob["apiVersion"], rayjob["kind"]) == ("ray.io/v1", "RayJob")
    assert sorted(mlflow_docs) == ["Deployment", "PersistentVolumeClaim", "Service"]


def test_kuberay_manifests_use_only_crd_fields(raycluster, rayjob):
    cluster_paths = field_paths(raycluster["spec"], "spec")
    job_paths = field_paths(rayjob["spec"], "spec")
    assert "spec.workerGroupSpecs[].labels.*" in cluster_paths  # the walk sees the fields
    assert sorted(cluster_paths - RAYCLUSTER_FIELDS) == []
    assert sorted(job_paths - RAYJOB_FIELDS) == []


def test_raycluster_has_token_auth(raycluster):
    spec = raycluster["spec"]
    assert spec["authOptions"]["mode"] == "token"
    # KubeRay refuses token mode without rayVersion >= 2.52.0.
    version = tuple(int(p) for p in spec["rayVersion"].split(".")[:2])
    assert version >= (2, 52)
    groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
    for group in groups:
        for container in group["template"]["spec"]["containers"]:
            names = {e["name"] for e in container.get("env", [])}
            # The operator injects both, the token from its Secret; never a literal here.
            assert not names & {"RAY_AUTH_TOKEN", "RAY_AUTH_MODE"}
    # The dashboard host is KubeRay's (0.0.0.0 in the pod, behind the token and a ClusterIP).
    assert "dashboard-host" not in spec["headGroupSpec"]["rayStartParams"]


def test_raycluster_has_one_pinned_labelled_group_per_silo(raycluster):
    groups = {g["groupName"]: g for g in raycluster["spec"]["workerGroupSpecs"]}
    assert sorted(groups) == sorted(SILOS)
    for silo, group in groups.items():
        assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == 1
        assert group["labels"] == {"silo": silo}
        assert "labels" not in group["rayStartParams"]  # KubeRay >= 1.5 rejects it there
        pod = group["template"]["spec"]
        assert pod["nodeSelector"] == {"silo-pfl/institution": silo}
        assert {"key": "silo-pfl/institution", "operator": "Equal", "value": silo} in [
            {k: t[k] for k in ("key", "operator", "value")} for t in pod["tolerations"]
        ]
        (container,) = pod["containers"]
        assert {"name": "SILO_PFL_DATA_DIR", "value": "/data"} in container["env"]
        (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/data"]
        (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
        assert "hostPath" in volume or "persistentVolumeClaim" in volume
    head = raycluster["spec"]["headGroupSpec"]
    assert "silo" not in head.get("labels", {})


def test_rayjob_runs_a_federation_on_the_cluster(raycluster, rayjob):
    from ray.runtime_env import RuntimeEnv

    spec = rayjob["spec"]
    assert spec["clusterSelector"] == {"ray.io/cluster": raycluster["metadata"]["name"]}
    # Under a clusterSelector KubeRay's deadline marks the RayJob Failed and stops nothing.
    assert "activeDeadlineSeconds" not in spec
    argv = shlex.split(spec["entrypoint"])
    assert argv[:4] == ["python", "-m", "silo_pfl", "run"]
    assert (ROOT / argv[4]).is_file()
    assert "ray.placement=per_node" in argv
    assert "privacy.central_models=global_only" in argv  # a real deployment's models stay home
    runtime_env = yaml.safe_load(spec["runtimeEnvYAML"])
    # working_dir is the repository inside the image; Ray checks a local path exists, so it is
    # validated apart: absolute, and the rest of the runtime_env through Ray's own parser.
    assert runtime_env["working_dir"] == "/home/ray/silo_pfl"
    RuntimeEnv(**{k: v for k, v in runtime_env.items() if k != "working_dir"})
    assert "SILO_PFL_DATA_DIR" not in runtime_env.get("env_vars", {})


def test_rayjob_tracking_uri_is_the_mlflow_service(rayjob, mlflow_docs):
    from mlflow.server.security_utils import is_allowed_host_header

    (uri,) = [
        a.split("=", 1)[1]
        for a in shlex.split(rayjob["spec"]["entrypoint"])
        if a.startswith("tracking.uri=")
    ]
    target = urlparse(uri)
    service = mlflow_docs["Service"]
    assert service["metadata"]["name"] == target.hostname == "silo-pfl-mlflow"
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == target.port == 5000]
    pod = mlflow_docs["Deployment"]["spec"]["template"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    assert port["targetPort"] in [p["name"] for p in container["ports"]] + [5000]
    command = container["command"]
    hosts = command[command.index("--allowed-hosts") + 1].split(",")
    assert is_allowed_host_header(hosts, target.netloc)  # MLflow's own Host header check


def test_mlflow_server_keeps_its_store_on_the_claim(mlflow_docs):
    deployment = mlflow_docs["Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    command = " ".join(container["command"])
    for part in (
        "mlflow server",
        "--backend-store-uri sqlite:////mlflow/mlflow.db",
        "--serve-artifacts",
        "--artifacts-destination /mlflow/artifacts",
        "--host 0.0.0.0",
        "--port 5000",
    ):
        assert part in command
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/mlflow"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    claim = mlflow_docs["PersistentVolumeClaim"]["metadata"]["name"]
    assert volume["persistentVolumeClaim"]["claimName"] == claim
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"]["type"] == "Recreate"  # one SQLite writer


# ---------------------------------------------------------------- runtime_env


def test_runtime_env_is_valid_and_leaves_local_state_behind(tmp_path):
    from ray._private.runtime_env.packaging import _get_excludes
    from ray.runtime_env import RuntimeEnv

    runtime_env = load(CLUSTER / "runtime_env.yaml")
    RuntimeEnv(**runtime_env)
    assert runtime_env["working_dir"] == "."
    assert runtime_env["env_vars"]["RAY_DEDUP_LOGS"] == "0"
    assert "SILO_PFL_DATA_DIR" not in runtime_env["env_vars"]  # per node, never job-wide
    excluded = _get_excludes(tmp_path, runtime_env["excludes"])
    left_behind = (
        ".venv",
        ".venv/bin/python",
        ".git/HEAD",
        "runs/a/results.json",
        "mlruns/0",
        "mlartifacts/1/model.pt",
        "mlflow.db",
        "results.json",
        "results_heart.json",
    )
    for path in left_behind:
        assert excluded(tmp_path / path), path
    for path in ("silo_pfl/__init__.py", "jobs/heart_disease.yaml", "cluster/runtime_env.yaml"):
        assert not excluded(tmp_path / path), path


# ---------------------------------------------------------------- scripts


def test_tracking_server_script_parses():
    subprocess.run(["bash", "-n", str(CLUSTER / "tracking_server.sh")], check=True)


def test_tracking_server_script_help_prints_its_usage_and_creates_nothing(tmp_path):
    store = tmp_path / "store"
    done = subprocess.run(
        ["bash", str(CLUSTER / "tracking_server.sh"), "--help"],
        env={"PATH": f"/usr/bin{os.pathsep}/bin", "MLFLOW_DIR": str(store)},
        capture_output=True,
        text=True,
        timeout=20,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert "cluster/tracking_server.sh [extra mlflow server options ...]" in done.stdout
    assert "MLFLOW_DIR" in done.stdout and "set -euo" not in done.stdout
    assert not store.exists() and list(tmp_path.iterdir()) == []


def test_tracking_server_script_execs_mlflow(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "mlflow.json"
    stub = bin_dir / "mlflow"
    stub.write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        "seen = {'pid': os.getpid(), 'argv': sys.argv[1:], "
        "'jobs': os.environ.get('MLFLOW_SERVER_ENABLE_JOB_EXECUTION')}\n"
        f"json.dump(seen, open({str(record)!r}, 'w'))\n"
    )
    stub.chmod(0o755)
    path = f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin"
    store = tmp_path / "store"
    env = {"PATH": path, "MLFLOW_DIR": str(store), "HOME": str(tmp_path)}
    proc = subprocess.Popen(
        ["bash", str(CLUSTER / "tracking_server.sh"), "--workers", "1"],
        env=env,
        stderr=subprocess.DEVNULL,
    )
    assert proc.wait(timeout=20) == 0
    seen = json.loads(record.read_text())
    assert seen["pid"] == proc.pid  # exec: the caller's pid is the server's
    argv = seen["argv"]
    assert argv[0] == "server"
    assert argv[argv.index("--backend-store-uri") + 1] == f"sqlite:///{store}/mlflow.db"
    assert "--serve-artifacts" in argv
    assert argv[argv.index("--artifacts-destination") + 1] == f"{store}/artifacts"
    assert (store / "artifacts").is_dir()
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert argv[argv.index("--port") + 1] == "5000"
    assert argv[-2:] == ["--workers", "1"]
    assert seen["jobs"] == "false"  # no task queue of seven processes a federation never uses

    env.update(HOST="10.10.0.10", PORT="5123", MLFLOW_SERVER_ENABLE_JOB_EXECUTION="true")
    subprocess.run(["bash", str(CLUSTER / "tracking_server.sh")], env=env, check=True)
    seen = json.loads(record.read_text())
    argv = seen["argv"]
    assert argv[argv.index("--host") + 1] == "10.10.0.10"
    assert argv[argv.index("--port") + 1] == "5123"
    assert seen["jobs"] == "true"  # an operator who asks for MLflow's jobs gets them

    env["PATH"] = f"/usr/bin{os.pathsep}/bin"  # no mlflow: a clear failure, not a hang
    missing = subprocess.run(
        ["bash", str(CLUSTER / "tracking_server.sh")], env=env, capture_output=True, text=True
    )
    if shutil.which("mlflow", path=env["PATH"]) is None:
        assert missing.returncode == 127
        assert "mlflow" in missing.stderr


def _handshake(ca: Path, cert: Path, key: Path, server_name: str) -> None:
    """A mutual-TLS handshake in memory, the client checking the server against server_name."""
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(cert, key)
    server.load_verify_locations(ca)
    server.verify_mode = ssl.CERT_REQUIRED
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.load_cert_chain(cert, key)
    client.load_verify_locations(ca)
    pipes = [ssl.MemoryBIO() for _ in range(4)]
    c = client.wrap_bio(pipes[0], pipes[1], server_hostname=server_name)
    s = server.wrap_bio(pipes[2], pipes[3], server_side=True)
    done = {"c": False, "s": False}
    for _ in range(20):
        for name, end in (("c", c), ("s", s)):
            if not done[name]:
                try:
                    end.do_handshake()
                    done[name] = True
                except ssl.SSLWantReadError:
                    pass
        pipes[2].write(pipes[1].read())
        pipes[0].write(pipes[3].read())
        if all(done.values()):
            return
    raise AssertionError("handshake did not finish")


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed")
def _own_addresses() -> set[str]:
    """What `hostname -I` lists: the addresses make_certs.sh adds for this machine."""
    done = subprocess.run(["hostname", "-I"], capture_output=True, text=True, check=False)
    return set(done.stdout.split()) if done.returncode == 0 else set()


def test_make_certs_gives_a_node_certificate_for_each_address(tmp_path):
    from cryptography import x509

    out = tmp_path / "tls"
    proc = subprocess.run(
        ["bash", str(CLUSTER / "make_certs.sh"), str(out), "127.0.0.1", "10.10.0.10", "head.lan"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    ca, cert, key = out / "ca.crt", out / "node.crt", out / "node.key"
    exports = dict(
        line.removeprefix("export ").split("=", 1) for line in proc.stdout.strip().splitlines()
    )
    assert exports == {
        "RAY_USE_TLS": "1",
        "RAY_TLS_SERVER_CERT": str(cert),
        "RAY_TLS_SERVER_KEY": str(key),
        "RAY_TLS_CA_CERT": str(ca),
    }
    for secret in (key, out / "ca.key"):
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    subprocess.run(
        ["openssl", "verify", "-CAfile", str(ca), str(cert)], check=True, capture_output=True
    )

    node = x509.load_pem_x509_certificate(cert.read_bytes())
    sans = node.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    ips = {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)}
    # Also this machine's own addresses: Ray advertises those for a node on 127.0.0.1.
    assert ips == {"127.0.0.1", "10.10.0.10", *_own_addresses()}
    assert set(sans.get_values_for_type(x509.DNSName)) == {"localhost", "head.lan"}

    for name in ("127.0.0.1", "localhost", "10.10.0.10", "head.lan"):
        _handshake(ca, cert, key, name)
    with pytest.raises(ssl.SSLCertVerificationError):
        _handshake(ca, cert, key, "10.10.0.99")  # an address the certificate does not name

    # Run again for another machine, naming only its address: the CA is kept, so both
    # certificates chain to it, and 127.0.0.1 and localhost are in by default.
    ca_before = ca.read_bytes()
    subprocess.run(
        ["bash", str(CLUSTER / "make_certs.sh"), str(out), "10.10.0.11"],
        capture_output=True,
        timeout=60,
        check=True,
    )
    assert ca.read_bytes() == ca_before
    subprocess.run(
        ["openssl", "verify", "-CAfile", str(ca), str(cert)], check=True, capture_output=True
    )
    node = x509.load_pem_x509_certificate(cert.read_bytes())
    sans = node.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)} == {
        "127.0.0.1",
        "10.10.0.11",
        *_own_addresses(),
    }
    assert sans.get_values_for_type(x509.DNSName) == ["localhost"]


def test_every_cluster_definition_sends_metrics_each_second(raycluster, onprem):
    """Ray's 10 s default would make every run's end wait 10 s for its last figures to be sent
    (runtime/metrics.py, DriverMetrics.settle): each definition asks for 1 s, where every Ray
    process and the run's driver read it."""
    spec = raycluster["spec"]
    for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
        for container in group["template"]["spec"]["containers"]:
            env = {e["name"]: e.get("value") for e in container.get("env", [])}
            assert env.get("RAY_metrics_report_interval_ms") == "1000", container["name"]
    head = " ".join(onprem["head_start_ray_commands"])
    config = re.search(r"--system-config='([^']*)'", head)
    assert config and json.loads(config.group(1)) == {"metrics_report_interval_ms": 1000}


# ---------------------------------------------------------------- examples and entry points

ENTRY_POINT = re.compile(r"(?:python -m silo_pfl (?:run|onboard)|silo-pfl submit)\b.*")
RAY_JOB_SUBMIT = re.compile(r"^((?:[A-Z_]+=\S+\s+)*)ray job submit\b")


def logical_lines(path: Path) -> list[str]:
    """A file's lines as a shell reads them: a trailing backslash joins the next one. Of a YAML
    file, its comments only, without their '#' (its fields are checked as YAML)."""
    lines, pending = [], ""
    for raw in path.read_text().splitlines():
        if path.suffix == ".yaml":
            if not raw.lstrip().startswith("#"):
                continue
            raw = raw.lstrip()[1:]
        line = raw.strip()
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        lines.append(pending + line)
        pending = ""
    return lines


def cluster_files() -> list[Path]:
    return sorted(p for p in CLUSTER.rglob("*") if p.suffix in (".yaml", ".py", ".sh"))


def output_dirs(command: str) -> list[str]:
    return [w.split("=", 1)[1] for w in shlex.split(command) if w.startswith("output_dir=")]


def test_every_entry_point_in_cluster_names_an_absolute_output_dir(rayjob):
    """A relative output_dir lies in Ray's per-session copy of a job's working_dir (or a pod's
    own disk): a node's restart loses the run, and --resume cannot find it. So in every run
    under cluster/, and every `ray job submit` of the README (`silo-pfl submit` ships no
    working_dir, and warns of a relative output_dir)."""
    from silo_pfl.runtime.jobs import output_dir_note

    commands = [
        (path.name, line)
        for path in cluster_files()
        for line in logical_lines(path)
        if ENTRY_POINT.search(line)
    ]
    commands.append(("rayjob.yaml spec.entrypoint", rayjob["spec"]["entrypoint"]))
    commands += [
        ("README.md", line)
        for line in logical_lines(ROOT / "README.md")
        if ENTRY_POINT.search(line) and RAY_JOB_SUBMIT.search(line)
    ]
    assert sorted({where for where, _ in commands}) == [
        "README.md",
        "local_cluster.py",
        "onprem.yaml",
        "rayjob.yaml spec.entrypoint",
        "runtime_env.yaml",
    ]
    for where, command in commands:
        given = output_dirs(command)
        assert len(given) == 1 and output_dir_note(given[0], False) is None, (where, command)
        # A shell expands an unquoted ~ on the submitting machine: its home, not the node's.
        assert not re.search(r"(^|\s)output_dir=~", command), (where, command)


def test_the_rayjob_output_dir_is_a_writable_volume_of_every_pod(raycluster, rayjob):
    (output_dir,) = output_dirs(rayjob["spec"]["entrypoint"])
    spec = raycluster["spec"]
    for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
        pod = group["template"]["spec"]
        (container,) = pod["containers"]
        mounts = [
            m
            for m in container.get("volumeMounts", [])
            if Path(output_dir).is_relative_to(m["mountPath"]) and not m.get("readOnly")
        ]
        assert len(mounts) == 1, group.get("groupName", "head")
        (volume,) = [v for v in pod["volumes"] if v["name"] == mounts[0]["name"]]
        assert "hostPath" in volume or "persistentVolumeClaim" in volume
        assert not volume.get("persistentVolumeClaim", {}).get("readOnly")


def test_every_ray_job_submit_example_turns_token_auth_on():
    """Ray's CLI sends the cluster's token only with RAY_AUTH_MODE=token; without it a token
    cluster refuses the submission."""
    examples = [
        (path, match)
        for path in [*cluster_files(), ROOT / "README.md"]
        for line in logical_lines(path)
        if (match := RAY_JOB_SUBMIT.search(line))
    ]
    assert {p.name for p, _ in examples} >= {"onprem.yaml", "runtime_env.yaml", "README.md"}
    for path, match in examples:
        assert "RAY_AUTH_MODE=token" in match.group(1).split(), (path, match.string)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed")
def test_make_certs_refuses_a_ca_certificate_without_its_key(tmp_path):
    """A node's copy of ca.crt (ca.key stays where certificates are signed) is never replaced by
    a new CA, which its peers would not trust."""
    script = str(CLUSTER / "make_certs.sh")
    subprocess.run(["bash", script, str(tmp_path / "ca")], capture_output=True, check=True)
    node = tmp_path / "node"
    node.mkdir()
    shutil.copy(tmp_path / "ca" / "ca.crt", node / "ca.crt")
    before = (node / "ca.crt").read_bytes()
    done = subprocess.run(["bash", script, str(node)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr == (
        f"make_certs.sh: {node}/ca.crt has no ca.key beside it, so it cannot sign; run this "
        "where the CA's ca.key is, or give another OUT_DIR for a new CA\n"
    )
    assert (node / "ca.crt").read_bytes() == before
    assert sorted(p.name for p in node.iterdir()) == ["ca.crt"]


def test_hospital_data_writes_every_hospital_when_none_is_named(tmp_path):
    script = str(CLUSTER / "hospital_data.py")
    done = subprocess.run(
        [sys.executable, script, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    written = [tmp_path / silo / "heart.csv" for silo in SILOS]
    assert done.stdout.split() == [str(path) for path in written]
    assert all(path.is_file() for path in written)
    bad = subprocess.run(
        [sys.executable, script, str(tmp_path / "x"), "va", "nowhere"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and not (tmp_path / "x").exists()
    assert bad.stderr == (
        "error: HOSPITAL: got 'nowhere', expected cleveland, hungarian, switzerland, va\n"
    )
