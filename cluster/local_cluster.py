"""A real multi-node Ray cluster on this one machine: a head and one labelled node per silo.

Every node is started with `ray start` on 127.0.0.1, with token authentication on; silo X's node
carries the label `silo=X`, so `ray.placement=per_node` puts each silo actor on its own node and
the server on the head. The dashboard (the Jobs API) listens on 127.0.0.1 only. The silos' nodes
start as many at once as there are cores, each on ports below the kernel's ephemeral range; a
node whose `ray start` fails is stopped, alone, and started again (three attempts in all).

    python cluster/local_cluster.py cleveland hungarian switzerland va --tracking-server
    silo-pfl submit jobs/heart_disease.yaml ray.placement=per_node \
        output_dir=/var/tmp/silo_pfl tracking.uri=<tracking_uri printed> \
        --address <dashboard printed>

Options: `--tracking-server` also starts an MLflow tracking server (SQLite, --serve-artifacts)
beside it; `--tls-dir DIR` turns on TLS between nodes with the certificates that
`cluster/make_certs.sh DIR` made; `--data-root DIR` gives silo X's node the environment variable
SILO_PFL_DATA_DIR=DIR/X, the per-node directory a CSV federation names as `$SILO_PFL_DATA_DIR`;
`--metrics-export-interval-s S` (default 1, Ray's floor; Ray's own default is 10) is how often
every process of the cluster, and every driver that joins it, sends its metrics to its node's
agent: a run's end waits that long for its last figures to be sent.

The token is $RAY_AUTH_TOKEN, else ~/.ray/auth_token (created if absent, as Ray itself does).
It prints one JSON line {"address", "dashboard", "head", "nodes": {silo: node_id},
"tracking_uri", "env", "marker"} (also to --info-file), then runs until SIGINT, SIGTERM or
SIGHUP and stops every process it started, and only those: each carries the environment variable
SILO_PFL_CLUSTER=<marker>, which is how they are found, the Ray workers included.

A silo's node that died (its raylet gone) comes back on SIGUSR1 (`kill -USR1 <pid>`), as an
institution restarts its node: with its label and environment, on fresh ports; the JSON line is
printed (and --info-file written) again with its new node id. A SIGUSR1 that comes while nodes
start again is done once they are up. A run that lost the node then finishes with `--resume`.
The head is not started again: its GCS held the cluster, whose loss ends every run on it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from silo_pfl.config import check_name
from silo_pfl.create_once import create_once
from silo_pfl.errors import ConfigError
from silo_pfl.runtime.jobs import auth_token
from silo_pfl.runtime.ray_token import default_token_path

MARKER_VAR = "SILO_PFL_CLUSTER"
DATA_DIR_VAR = "SILO_PFL_DATA_DIR"
SILO_LABEL = "silo"
HOST = "127.0.0.1"
BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT = 180.0
GCS_NAME = "gcs_server"  # a Ray GCS process's name (/proc/<pid>/comm)
RAYLET_NAME = "raylet"  # a Ray node's raylet (/proc/<pid>/comm): the node lives while it does
STOP_POLL_SECONDS = 0.1
EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
PORT_FLOOR = 20000  # above Ray's worker ports (10002-19999)
NODE_VAR = "SILO_PFL_NODE"  # which node of the cluster a process belongs to
NODE_START_ATTEMPTS = 3


def free_ports(count: int, exclude: Collection[int] = ()) -> list[int]:
    """`count` distinct TCP ports that nothing listens on now, none in `exclude`.

    They are drawn from below the kernel's ephemeral range (and above Ray's worker ports, 10002
    to 19999): a port from that range can be taken by any outgoing connection before its server
    binds it, and a node whose metrics port is taken never registers (`ray start` fails after
    30 s: "The current node timed out during startup"). Held open together while chosen."""
    low = int(Path(EPHEMERAL_RANGE).read_text().split()[0])
    pool = [port for port in range(PORT_FLOOR, low) if port not in exclude]
    secrets.SystemRandom().shuffle(pool)
    ports: list[int] = []
    with contextlib.ExitStack() as stack:
        for port in pool:
            sock = stack.enter_context(socket.socket())
            try:
                sock.bind((HOST, port))
            except OSError:
                continue
            ports.append(port)
            if len(ports) == count:
                return ports
    raise RuntimeError(f"fewer than {count} free ports between {PORT_FLOOR} and {low}")


def port_in_use(port: int) -> bool:
    """Whether something listens on (or holds) loopback `port` now. Ray does not refuse a
    dashboard port that is taken: the head starts without a dashboard, and the port answers for
    whatever holds it, another cluster's Jobs API say."""
    with socket.socket() as sock:
        try:
            sock.bind((HOST, port))
        except OSError:
            return True
    return False


def cluster_token() -> str:
    """The token clients find too (silo_pfl's `auth_token`); else a new ~/.ray/auth_token, made
    whole and private (0600) at once, or the one another process made meanwhile."""
    token = auth_token()
    if token is None:
        create_once(default_token_path(), secrets.token_hex(32).encode("ascii"))
        token = default_token_path().read_text(encoding="ascii").strip()
    return token


def tls_env(tls_dir: str | None) -> dict[str, str]:
    """Ray's TLS variables for certificates made by cluster/make_certs.sh, or nothing."""
    if not tls_dir:
        return {}
    base = Path(tls_dir).resolve()
    for name in ("ca.crt", "node.crt", "node.key"):
        if not (base / name).is_file():
            sys.exit(f"error: --tls-dir {base}: no {name}; run cluster/make_certs.sh {base}")
    return {
        "RAY_USE_TLS": "1",
        "RAY_TLS_SERVER_CERT": str(base / "node.crt"),
        "RAY_TLS_SERVER_KEY": str(base / "node.key"),
        "RAY_TLS_CA_CERT": str(base / "ca.crt"),
    }


def _processes_marked(marker: str, node: str | None = None) -> list[int]:
    """Pids of the live processes carrying SILO_PFL_CLUSTER=<marker> (and SILO_PFL_NODE=<node>,
    if given), and their descendants.

    Descendants count too: a process that rewrites its title can hide its environment."""
    needles = {f"{MARKER_VAR}={marker}".encode()}
    if node is not None:
        needles.add(f"{NODE_VAR}={node}".encode())
    marked, parents = set(), {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if fields[0] == "Z":
                continue
            parents[int(entry.name)] = int(fields[1])
            if needles <= set((entry / "environ").read_bytes().split(b"\0")):
                marked.add(int(entry.name))
        except (OSError, IndexError):
            continue
    grew = True
    while grew:
        children = {pid for pid, parent in parents.items() if parent in marked} - marked
        marked |= children
        grew = bool(children)
    return sorted(marked)


def _named(pid: int, name: str) -> bool:
    """Whether process `pid`'s executable is called `name` (as `ray stop` finds Ray's)."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() == name
    except OSError:
        return False


def _is_gcs(pid: int) -> bool:
    """Whether `pid` is a Ray GCS server."""
    return _named(pid, GCS_NAME)


def _stop(pids: Callable[[], list[int]], grace: float) -> None:
    """SIGTERM the processes `pids()` lists; SIGKILL those it still lists after `grace` s."""
    for pid in pids():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while pids() and time.monotonic() < deadline:
        time.sleep(STOP_POLL_SECONDS)
    for pid in pids():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def stop_marked(marker: str, grace: float = 15.0, node: str | None = None) -> list[int]:
    """Stop every process carrying the marker (of `node` only, if given) in Ray's own order
    (`ray stop`'s): all but the GCS servers first, then what is left; each stage SIGTERM, then
    SIGKILL after `grace` seconds.
    Stopped all at once, the GCS went first and the raylets and the autoscaler monitor waited on
    it, 10 s and until the SIGKILL.

    Returns the pids still alive at the end (none, normally)."""
    _stop(lambda: [pid for pid in _processes_marked(marker, node) if not _is_gcs(pid)], grace)
    _stop(lambda: _processes_marked(marker, node), grace)
    time.sleep(0.5)
    return _processes_marked(marker, node)


# Prints the live nodes as JSON once exactly `count` of them are alive (or after START_TIMEOUT),
# not counting the node ids of argv[3] (nodes known dead): a node whose start failed, and was
# stopped, or that died, may be listed alive until the GCS misses it (15 s or more).
_NODES_SCRIPT = f"""
import json, sys, time
import ray
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
dead = set(json.loads(sys.argv[3]))
deadline = time.monotonic() + {START_TIMEOUT}
while True:
    alive = [n for n in ray.nodes() if n["Alive"] and n["NodeID"] not in dead]
    if len(alive) == int(sys.argv[2]) or time.monotonic() > deadline:
        break
    time.sleep(0.5)
print(json.dumps([{{"id": n["NodeID"], "labels": n["Labels"]}} for n in alive]))
"""


class LocalCluster:
    """Starts the nodes (and the tracking server); `stop` ends every process it started."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.marker = secrets.token_hex(8)
        self.tls = tls_env(args.tls_dir)  # these two may refuse: before any directory is made
        token = cluster_token()
        self.workdir = Path(tempfile.mkdtemp(prefix="silo-pfl-cluster-"))
        # Ray's socket paths must stay short: its temp dir lives directly under /tmp.
        self.temp_dir = Path(tempfile.mkdtemp(prefix="rc", dir="/tmp"))
        self.env = {
            **os.environ,
            MARKER_VAR: self.marker,
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": token,
            **self.tls,
            # As on a node with this environment activated: a job's `python` is this one.
            "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        }
        self._ports_given: set[int] = set()
        self._ports_lock = threading.Lock()
        self.node_names = {silo: f"n{i + 1}" for i, silo in enumerate(args.silos)}
        self._starts: dict[str, int] = {}  # `ray start`s of each node so far: its temp dirs
        self.info: dict = {}
        self.tracking_port = args.tracking_port or self._ports(1)[0]
        self.gcs_port = self.client_port = self.dashboard_port = 0  # set as the head starts
        self.tracking_uri: str | None = None

    def _ports(self, count: int) -> list[int]:
        """`count` free ports this cluster has not handed out before: a port chosen for one node
        is not bound until its `ray start` runs, while the others choose theirs."""
        with self._ports_lock:
            ports = free_ports(count, exclude=self._ports_given)
            self._ports_given.update(ports)
        return ports

    def _start_node(self, node: str, options: Callable[[], list[str]], env: dict[str, str]) -> None:
        """`ray start` one node, up to NODE_START_ATTEMPTS times. A start that failed (on a
        loaded machine, a raylet that did not register within Ray's 30 s) is stopped, its
        processes and no other node's, and made again with fresh ports and a fresh temp dir;
        `options()` gives each attempt its own options."""
        for attempt in range(1, NODE_START_ATTEMPTS + 1):
            self._starts[node] = self._starts.get(node, 0) + 1
            try:
                self._ray_start(f"{node}.{self._starts[node]}", options(), {**env, NODE_VAR: node})
                return
            except RuntimeError as failed:
                stop_marked(self.marker, node=node)
                if attempt == NODE_START_ATTEMPTS:
                    raise
                print(f"warning: node {node}: {failed}; starting it again", file=sys.stderr)

    def _ray_start(self, temp_name: str, extra: list[str], env: dict[str, str]) -> None:
        """`ray start` one node, with an agent port and a metrics port of its own (the defaults
        are fixed, and every node of this machine needs its own). Each node has a temp dir of
        its own, as on its own machine: a node that found a shared one would delete job files
        another node still uses."""
        agent_port, metrics_port = self._ports(2)
        command = [
            str(BIN / "ray"),
            "start",
            f"--node-ip-address={HOST}",
            f"--num-cpus={self.args.cpus_per_node}",
            f"--temp-dir={self.temp_dir / temp_name}",
            f"--dashboard-agent-listen-port={agent_port}",
            f"--metrics-export-port={metrics_port}",
            "--disable-usage-stats",
            *extra,
        ]
        done = subprocess.run(
            command,
            env=env,
            capture_output=True,
            text=True,
            timeout=START_TIMEOUT,
            start_new_session=True,
        )
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
            raise RuntimeError(f"{' '.join(command[:3])} failed: {' | '.join(tail)}")

    def _head_options(self) -> list[str]:
        """The head's options for one attempt to start it, with fresh ports of its own."""
        self.gcs_port, self.client_port = self._ports(2)
        self.dashboard_port = self.args.dashboard_port or self._ports(1)[0]
        return [
            "--head",
            f"--port={self.gcs_port}",
            f"--dashboard-host={HOST}",
            f"--dashboard-port={self.dashboard_port}",
            f"--ray-client-server-port={self.client_port}",
            "--labels=silo-pfl/role=head",
            # The head's system config reaches every node and every driver that joins.
            "--system-config="
            + json.dumps({"metrics_report_interval_ms": round(1000 * self.args.metrics_interval)}),
        ]

    def start(self) -> dict:
        """Start the head, then the silos' nodes (as many at once as there are cores: each then
        registers well within Ray's 30 s), the tracking server meanwhile; return the cluster
        info."""
        tracking = self._launch_tracking_server() if self.args.tracking_server else None
        self._start_node("head", self._head_options, self.env)
        address = f"{HOST}:{self.gcs_port}"
        self._start_silo_nodes(self.args.silos, address)
        if tracking:
            self.tracking_uri = self._await_tracking_server(*tracking)
        head, nodes = self._node_ids(address)
        self.info = {
            "address": address,
            "dashboard": f"http://{HOST}:{self.dashboard_port}",
            "head": head,
            "nodes": nodes,
            "tracking_uri": self.tracking_uri,
            "env": {"RAY_AUTH_MODE": "token", **self.tls},
            "marker": self.marker,
        }
        return self.info

    def _start_silo_nodes(self, silos: list[str], address: str) -> None:
        """`ray start` these silos' nodes into the cluster at `address`, as many at once as there
        are cores, each labelled silo=<name> with its silo's environment."""
        with ThreadPoolExecutor(max_workers=min(len(silos), os.cpu_count() or 1)) as pool:
            starts = [
                pool.submit(
                    self._start_node,
                    self.node_names[silo],
                    lambda silo=silo: [f"--address={address}", f"--labels={SILO_LABEL}={silo}"],
                    self._node_env(silo),
                )
                for silo in silos
            ]
            for started in starts:
                started.result()

    def lost(self) -> list[str]:
        """The silos whose node has no raylet running: it died, or was killed."""
        return [
            silo
            for silo, node in self.node_names.items()
            if not any(_named(pid, RAYLET_NAME) for pid in _processes_marked(self.marker, node))
        ]

    def restart_lost(self) -> list[str]:
        """Start again the silos' nodes that died, each as it first started (its label and
        environment, fresh ports and a fresh temp dir), after stopping what is left of it; the
        info's node ids are then the new ones. Returns the silos restarted."""
        silos = self.lost()
        if not silos:
            return []
        for silo in silos:
            stop_marked(self.marker, node=self.node_names[silo])
        self._start_silo_nodes(silos, self.info["address"])
        dead = [self.info["nodes"][silo] for silo in silos]
        self.info["head"], self.info["nodes"] = self._node_ids(self.info["address"], dead)
        return silos

    def _node_ids(self, address: str, dead: Collection[str] = ()) -> tuple[str, dict[str, str]]:
        """Wait until every node is alive (not counting the nodes `dead` names, which the GCS may
        still list); the head's node id and each silo's.

        Asked by a fresh Python process: one that already ran with other settings can keep
        Ray's authentication mode from before its environment changed."""
        count = str(1 + len(self.args.silos))
        done = subprocess.run(
            [sys.executable, "-c", _NODES_SCRIPT, address, count, json.dumps(list(dead))],
            env={k: v for k, v in self.env.items() if k != MARKER_VAR},
            capture_output=True,
            text=True,
            timeout=START_TIMEOUT,
        )
        if done.returncode != 0:
            raise RuntimeError(f"cannot list the nodes: {done.stderr.strip()[-500:]}")
        by_silo = {n["labels"].get(SILO_LABEL): n["id"] for n in json.loads(done.stdout)}
        missing = [s for s in self.args.silos if s not in by_silo]
        if missing:
            raise RuntimeError(f"nodes of {', '.join(missing)} did not join in time")
        return by_silo.pop(None), {s: by_silo[s] for s in self.args.silos}

    def _node_env(self, silo: str) -> dict[str, str]:
        """Silo `silo`'s node's environment: the cluster's, with its data directory if any."""
        env = dict(self.env)
        if self.args.data_root:
            env[DATA_DIR_VAR] = str(Path(self.args.data_root).resolve() / silo)
        return env

    def _launch_tracking_server(self) -> tuple[str, Path]:
        """`cluster/tracking_server.sh` on a free loopback port: its URI and its log."""
        env = {
            **self.env,
            "HOST": HOST,
            "PORT": str(self.tracking_port),
            "MLFLOW_DIR": str(self.workdir / "mlflow"),
        }
        log = self.workdir / "mlflow.log"
        with log.open("w") as output:
            subprocess.Popen(
                ["bash", str(ROOT / "cluster" / "tracking_server.sh")],
                env=env,
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return f"http://{HOST}:{self.tracking_port}", log

    def _await_tracking_server(self, uri: str, log: Path) -> str:
        """`uri` once the tracking server answers there."""
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"{uri}/health", timeout=2).close()
                return uri
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"the tracking server did not answer at {uri}; see {log}")

    def stop(self) -> list[int]:
        """Stop every process this cluster started; remove its directories. Pids left over."""
        left = stop_marked(self.marker)
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        shutil.rmtree(self.workdir, ignore_errors=True)
        return left


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="It prints the cluster's JSON line and runs until SIGINT, SIGTERM or SIGHUP, then "
        "stops every process it started. SIGUSR1 starts the silos' nodes that died again and "
        "prints the line again, with their new node ids.",
    )
    parser.add_argument("silos", nargs="+", help="silo names, one node each")
    parser.add_argument(
        "--cpus-per-node", type=int, default=1, help="CPUs each node offers (default 1)"
    )
    parser.add_argument("--info-file", help="also write the JSON line here")
    parser.add_argument("--dashboard-port", type=int, help="the Jobs API port (default: free)")
    parser.add_argument("--tracking-server", action="store_true", help="start mlflow server")
    parser.add_argument("--tracking-port", type=int, help="its port (default: free)")
    parser.add_argument("--tls-dir", help="TLS between nodes, certificates of make_certs.sh")
    parser.add_argument("--data-root", help="silo X's node gets SILO_PFL_DATA_DIR=DATA_ROOT/X")
    parser.add_argument(
        "--metrics-export-interval-s",
        dest="metrics_interval",
        type=float,
        default=1.0,
        help="how often Ray's processes send their metrics (>= 1 s; Ray's default 10 s)",
    )
    return parser


STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}  # a closed terminal stops it too
RESTART_SIGNAL = signal.SIGUSR1  # start the silos' nodes that died again


def _announce(info: dict, info_file: str | None) -> None:
    """Print the cluster's JSON line, and write it to `info_file` (whole, then renamed)."""
    line = json.dumps(info)
    if info_file:
        written = Path(f"{info_file}.tmp")
        written.write_text(line + "\n")
        written.replace(info_file)
    print(line, flush=True)


def _serve(
    cluster: LocalCluster, info_file: str | None, requested: list[int], restarts: list[int]
) -> None:
    """Until a stop signal: on RESTART_SIGNAL, start the lost nodes again and announce the new
    info. The signals are blocked and waited for, so none that came in between is lost; while
    nodes start they are not (a process inherits its parent's mask), and the handlers note one
    that comes then: a stop ends the serving, a restart (another node may have died meanwhile)
    is done once the one under way is."""
    waited = STOP_SIGNALS | {RESTART_SIGNAL}
    while True:
        signal.pthread_sigmask(signal.SIG_BLOCK, waited)
        if requested:
            return
        if restarts:
            restarts.clear()
        elif signal.sigwait(waited) != RESTART_SIGNAL:
            return
        signal.pthread_sigmask(signal.SIG_UNBLOCK, waited)
        try:
            restarted = cluster.restart_lost()
        except (RuntimeError, subprocess.SubprocessError) as exc:  # the other nodes stay up
            print(f"error: a lost node did not start again: {exc}", file=sys.stderr, flush=True)
            continue
        names = ", ".join(restarted) if restarted else "none: every node is alive"
        print(f"nodes started again: {names}", file=sys.stderr, flush=True)
        if restarted:
            _announce(cluster.info, info_file)


def main() -> None:
    parser = _parser()
    args = parser.parse_args()
    if not args.metrics_interval >= 1:
        parser.error(f"--metrics-export-interval-s: got {args.metrics_interval}, expected >= 1")
    for silo in args.silos:  # each is a node's label value, silo=<name>
        try:
            check_name(silo, "SILOS", "silo name ")
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            sys.exit(2)
    twice = sorted({silo for silo in args.silos if args.silos.count(silo) > 1})
    if twice:
        print(f"error: SILOS: {', '.join(twice)} given twice; one node per silo", file=sys.stderr)
        sys.exit(2)
    for option, port in (
        ("--dashboard-port", args.dashboard_port),
        ("--tracking-port", args.tracking_port),
    ):
        if port is not None and port_in_use(port):
            print(
                f"error: {option} {port}: in use on {HOST}; give a free port, or leave "
                f"{option} out for one",
                file=sys.stderr,
            )
            sys.exit(2)
    # While the nodes start, a stop signal is only noted (no lock may be taken in a handler: an
    # Event.set there can deadlock with the wait it interrupts); then the main thread blocks the
    # signals and waits for one, so one that came in between is not lost.
    requested: list[int] = []
    restarts: list[int] = []
    for signum in STOP_SIGNALS:
        signal.signal(signum, lambda number, _frame: requested.append(number))
    signal.signal(RESTART_SIGNAL, lambda number, _frame: restarts.append(number))
    try:
        cluster = LocalCluster(args)
    except ConfigError as exc:  # the token: before any directory is made
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    try:
        _announce(cluster.start(), args.info_file)
        restarts.clear()  # no node was lost before the cluster was up
        _serve(cluster, args.info_file, requested, restarts)
    except Exception as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
    finally:
        left = cluster.stop()
        if left:
            print(f"error: processes left running: {left}", file=sys.stderr)
            sys.exit(1)


if __name__ == "__main__":
    main()
