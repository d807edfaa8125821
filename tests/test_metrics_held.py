"""A gauge's last value stays on Ray's metrics endpoint while its process lives: Ray's agent
drops a gauge series not set within two export intervals, and Prometheus scrapes every 5 s, so a
figure set once a round must be held (runtime.metrics._Held). A fresh local Ray in a
subprocess, with the 1 s export interval a run uses."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import json, time, urllib.request
from silo_pfl.config import RayConfig
from silo_pfl.runtime import metrics
from silo_pfl.runtime.session import ray_session

tags = {"federation": "held", "run_id": "r1", "algorithm": "fedavg"}
with ray_session(RayConfig(num_cpus=1), metrics_interval_s=1.0):
    url = f"http://127.0.0.1:{metrics.local_metrics_port()}/metrics"
    metrics._set("silo_pfl_round", 3, tags)
    straggler = "silo_pfl_straggler_seconds"
    metrics._set(straggler, 0.5, {**tags, "silo": "a"}, alone=True)
    metrics._set(straggler, 0.7, {**tags, "silo": "b"}, alone=True)
    began, seen = time.monotonic(), []
    while time.monotonic() - began < 9:
        body = urllib.request.urlopen(url, timeout=5).read().decode()
        lines = [x for x in body.splitlines() if x.startswith("ray_silo_pfl_")]
        seen.append((round(time.monotonic() - began, 1), lines))
        time.sleep(0.5)
print("SEEN " + json.dumps(seen))
"""


def test_a_gauge_set_once_stays_until_its_process_ends_and_a_straggler_keeps_one_silo():
    with tempfile.TemporaryDirectory(prefix="held", dir="/tmp") as temp:
        done = subprocess.run(
            [sys.executable, "-c", SCRIPT],
            cwd=ROOT,
            env={"PATH": "/usr/bin:/bin", "HOME": temp, "RAY_TMPDIR": temp},
            capture_output=True,
            text=True,
            timeout=180,
        )
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("SEEN ")]
    seen = json.loads(line.removeprefix("SEEN "))
    rounds = [any(x.startswith("ray_silo_pfl_round{") for x in lines) for _, lines in seen]
    first = rounds.index(True)
    assert all(rounds[first:]), [t for (t, _), r in zip(seen, rounds, strict=True) if not r]
    assert seen[-1][0] - seen[first][0] >= 6, "too short a watch to outlast Ray's 2 s TTL"
    tail = [lines for t, lines in seen if t >= seen[first][0] + 4]
    for lines in tail:
        stragglers = [x for x in lines if x.startswith("ray_silo_pfl_straggler_seconds{")]
        assert len(stragglers) == 1 and 'silo="b"' in stragglers[0], stragglers
