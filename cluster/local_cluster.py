"""A real multi-node Ray cluster on this one machine, one node per silo.

Each silo's node offers the custom resource `silo_<name>`, so `ray.placement=per_node` puts
every silo actor on its own node; the head node hosts the server. Use it to try a federation
as it would run across premises:

    python cluster/local_cluster.py cleveland hungarian switzerland va &
    silo-pfl run jobs/heart_disease.yaml ray.address=<address printed> ray.placement=per_node

It prints one JSON line {"address", "head", "nodes": {silo: node_id}} (also to --info-file),
then runs until interrupted (SIGINT/SIGTERM), and stops only the nodes it started.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from pathlib import Path

from ray.cluster_utils import Cluster

from silo_pfl.runtime.actors import silo_resource


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("silos", nargs="+", help="silo names, one node each")
    parser.add_argument("--cpus-per-node", type=int, default=1)
    parser.add_argument("--info-file", help="also write the JSON line here")
    parser.add_argument("--dashboard", action="store_true", help="start the dashboard (Ray Jobs)")
    args = parser.parse_args()

    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": args.cpus_per_node,
            "include_dashboard": args.dashboard,
        },
    )
    stop = threading.Event()
    try:
        nodes = {
            silo: cluster.add_node(
                num_cpus=args.cpus_per_node,
                resources={silo_resource(silo): 1},
            ).node_id
            for silo in args.silos
        }
        cluster.wait_for_nodes()
        # Installed after the nodes start: Ray's own node handlers would replace them.
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda *_: stop.set())
        info = {"address": cluster.address, "head": cluster.head_node.node_id, "nodes": nodes}
        line = json.dumps(info)
        if args.info_file:
            Path(args.info_file).write_text(line + "\n")
        print(line, flush=True)
        stop.wait()
    finally:
        cluster.shutdown()
    sys.exit(0)


if __name__ == "__main__":
    main()
