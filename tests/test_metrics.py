"""Live metrics: a real Prometheus scrapes Ray's metrics while a real federation runs, through the
service-discovery file of the Ray session the run starts; every metric arrives with its tags, and
every panel of the Grafana dashboard reads a metric the run exports."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from processes import stop_group
from serving import free_port

from silo_pfl.runtime.metrics import (
    METRIC_NAMES,
    METRICS,
    NoMetrics,
    _instruments,
    driver_metrics,
    metrics_enabled,
)
from silo_pfl.runtime.session import local_options
from silo_pfl.settings import load_config

ROOT = Path(__file__).resolve().parents[1]
PROMETHEUS = Path("/usr/bin/prometheus")
DASHBOARD = ROOT / "dashboards" / "grafana" / "silo_pfl.json"
SILOS = ("silo_0", "silo_1")
ROUNDS = 3
ARRIVAL_SECONDS = 60  # how long the series may take to show up in Prometheus after the run


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


@pytest.fixture
def ray_tmp() -> Iterator[Path]:
    """A Ray temp root of the test's own (short: Ray's sockets live under it), so that the
    service-discovery file is this run's, whatever else runs Ray on the machine."""
    path = Path(tempfile.mkdtemp(prefix="spm", dir="/tmp"))
    (path / "ray").mkdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def prometheus(tmp_path: Path, ray_tmp: Path) -> Iterator[SimpleNamespace]:
    """Debian's Prometheus with dashboards/prometheus/prometheus.yml, its service-discovery file
    moved to the test's Ray temp root and its intervals to 1 s; on a free port."""
    if not PROMETHEUS.exists():
        pytest.skip(f"{PROMETHEUS} is absent (Debian's package prometheus)")
    config = yaml.safe_load((ROOT / "dashboards" / "prometheus" / "prometheus.yml").read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    for job in config["scrape_configs"]:
        for sd in job["file_sd_configs"]:
            sd["files"] = [f.replace("/tmp/ray/", f"{ray_tmp}/ray/") for f in sd["files"]]
            sd["refresh_interval"] = "1s"
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    port = free_port()
    log = (tmp_path / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [
            str(PROMETHEUS),
            f"--config.file={path}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"{url}/-/ready", timeout=2)
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                stop_group(proc)
                pytest.fail(
                    f"prometheus did not start: {(tmp_path / 'prometheus.log').read_text()}"
                )
            time.sleep(0.5)
    yield SimpleNamespace(url=url, log=tmp_path / "prometheus.log")
    stop_group(proc)


def _query(url: str, expr: str, at: float | None = None) -> list[dict[str, Any]]:
    params = {"query": expr} if at is None else {"query": expr, "time": at}
    answer = _get(f"{url}/api/v1/query?" + urllib.parse.urlencode(params))
    assert answer["status"] == "success", answer
    return answer["data"]["result"]


def _series(url: str, run_id: str) -> dict[str, list[dict[str, Any]]]:
    """Every metric's series of the run, as exported by Ray: the last value within 15 minutes
    (a local Ray has stopped by now, so Prometheus has marked its series stale)."""
    found = {}
    for spec in METRICS:
        exported = f"ray_{spec.name}" + ("_total" if spec.kind == "counter" else "")
        found[spec.name] = _query(url, f'last_over_time({exported}{{run_id="{run_id}"}}[15m])')
    return found


def test_prometheus_scrapes_every_metric_of_a_run_with_its_tags(tmp_path, ray_tmp, prometheus):
    """A secure-aggregation run of two silos in which silo_1's training turns to NaN in round 2
    (the nan_once plugin): that round's first attempt leaves its update out, under secure
    aggregation without a quorum, and the retry aggregates both."""
    results = tmp_path / "results.json"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(
        RAY_TMPDIR=str(ray_tmp),
        PYTHONPATH=str(ROOT),
    )
    began = time.time()
    run = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "silo_pfl",
            "run",
            "jobs/digits_label_skew.yaml",
            f"rounds={ROUNDS}",
            "data.num_silos=2",
            "data.partition=iid",
            "data.max_train_rows=200",
            "model.name=mlp",
            "model.hidden=[16]",
            "train.local_epochs=1",
            "plugins=[tests.fault_plugins]",
            "algorithm.name=nan_once",
            "algorithm.nan_once.silo=silo_1",
            "algorithm.nan_once.round=2",
            "aggregation.secure=true",
            "tracking.enabled=false",
            "metrics.enabled=true",
            "ray.num_cpus=2",
            f"output_dir={tmp_path / 'runs'}",
            "--results",
            str(results),
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = run.communicate(timeout=900)
    finally:
        stop_group(run)
    assert run.returncode == 0, output[-3000:]
    result = json.loads(results.read_text())
    run_id = result["run_id"]
    assert [h["attempts"] for h in result["history"]] == [1, 2, 1]

    deadline = time.monotonic() + ARRIVAL_SECONDS
    while True:
        found = _series(prometheus.url, run_id)
        missing = sorted(name for name, series in found.items() if not series)
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert not missing, f"not in Prometheus: {missing}; {prometheus.log.read_text()[-2000:]}"

    run_tags = {"federation": "digits_label_skew", "run_id": run_id, "algorithm": "nan_once"}
    for spec in METRICS:
        for series in found[spec.name]:
            labels = series["metric"]
            assert {k: labels.get(k) for k in run_tags} == run_tags, (spec.name, labels)
            assert set(spec.tags) <= set(labels), (spec.name, labels)
            if "silo" in spec.tags:
                assert labels["silo"] in SILOS, (spec.name, labels)

    def values(name: str) -> dict[str, float]:
        return {s["metric"].get("silo", ""): float(s["value"][1]) for s in found[name]}

    assert values("silo_pfl_round") == {"": ROUNDS}
    assert values("silo_pfl_silos_alive") == {"": len(SILOS)}
    assert 0 < values("silo_pfl_round_seconds")[""] < time.time() - began
    assert values("silo_pfl_secure_unmask_seconds")[""] > 0
    for name in ("silo_pfl_silo_val_accuracy", "silo_pfl_silo_test_accuracy"):
        assert set(values(name)) == set(SILOS)
        assert all(0 <= v <= 1 for v in values(name).values()), values(name)
    for name in (
        "silo_pfl_silo_train_seconds",
        "silo_pfl_silo_bytes_sent",
        "silo_pfl_silo_bytes_received",
        "silo_pfl_secure_mask_seconds",
    ):
        assert set(values(name)) == set(SILOS), name
        assert all(v > 0 for v in values(name).values()), (name, values(name))
    per_round = result["silos"]["silo_0"]["bytes_sent_per_round"]
    sent = values("silo_pfl_silo_bytes_sent")
    # Every attempt (4), each silo sent its signed round keys and its sealed shares to the other;
    # silo_0 sent its masked vector every time, silo_1 withheld one.
    # With its masked vector, its signed pairing: a signature and its peer's name.
    keys_and_shares = 32 + 32 + 64 + (2 * 66 + 16) * (len(SILOS) - 1)
    masked = per_round + 64 + len("silo_1")
    assert sent == {
        "silo_0": 4 * (masked + keys_and_shares),
        "silo_1": 3 * masked + 4 * keys_and_shares,
    }
    # Each silo's process fitted every attempt (silo_1's withheld update too): the bytes panels
    # divide by these, which restart with the process as the bytes counters do.
    assert values("silo_pfl_silo_fits") == {"silo_0": 4.0, "silo_1": 4.0}
    straggler = found["silo_pfl_straggler_seconds"]
    assert all(float(s["value"][1]) >= 0 for s in straggler)
    left_out = {
        (s["metric"]["silo"], s["metric"]["reason"]): float(s["value"][1])
        for s in found["silo_pfl_updates_left_out"]
    }
    assert left_out == {("silo_1", "withheld"): 1.0}

    # The run's last scrape, taken while the run lingered, holds each silo's last figures.
    samples = _query(prometheus.url, f'{{run_id="{run_id}"}}[15m]')
    last = max(float(t) for series in samples for t, _ in series["values"])
    final = result["history"][-1]["silos"]
    for name, field in (("val", "val_accuracy"), ("test", "test_accuracy")):
        at_end = _query(
            prometheus.url, f'ray_silo_pfl_silo_{name}_accuracy{{run_id="{run_id}"}}', last
        )
        got = {s["metric"]["silo"]: float(s["value"][1]) for s in at_end}
        assert got == pytest.approx({n: final[n][field] for n in SILOS}), (name, got)
    _every_panel_has_data(prometheus.url, run_id, began)
    _left_out_sum_reads_zero_when_none(prometheus.url, run_id)


def _every_panel_has_data(url: str, run_id: str, began: float) -> None:
    """Each panel query of the dashboard, with its variables set to this run, returns series
    over the run's time range (as Grafana asks for them, one point a second).

    The points end at the run's last scrape: a short run's driver figures may be in that scrape
    alone, and the target's removal when Ray stops marks them stale within a second, so points
    that merely step past it may all miss them."""
    samples = _query(url, f'{{run_id="{run_id}"}}[15m]')
    last = max(float(t) for series in samples for t, _ in series["values"])
    names = {"federation": "digits_label_skew", "run_id": run_id, "silo": ".*"}
    for expr in _exprs(json.loads(DASHBOARD.read_text()))[0]:
        query = re.sub(r"\$(\w+)", lambda m: names[m.group(1)], expr)
        params = {"query": query, "start": last - int(last - began), "end": last, "step": 1}
        answer = _get(f"{url}/api/v1/query_range?" + urllib.parse.urlencode(params))
        assert answer["status"] == "success", (expr, answer)
        assert answer["data"]["result"], f"no data for panel query {expr}: {samples}"


def _left_out_sum_reads_zero_when_none(url: str, run_id: str) -> None:
    """The "all silos" line of the updates-left-out panel, at the run's last scrape: this run's
    one withheld update; and 0, not "No data", for a run that left none out (the same query
    with the counter, which such a run never creates, absent)."""
    samples = _query(url, f'{{run_id="{run_id}"}}[15m]')
    last = max(float(t) for series in samples for t, _ in series["values"])
    panels = json.loads(DASHBOARD.read_text())["panels"]
    panel = next(p for p in panels if p["title"] == "Updates left out")
    expr = next(t["expr"] for t in panel["targets"] if t["legendFormat"] == "all silos")
    query = expr.replace("$federation", "digits_label_skew").replace("$run_id", run_id)
    assert [float(r["value"][1]) for r in _query(url, query, last)] == [1.0]
    counter = "ray_silo_pfl_updates_left_out_total"
    none_left_out = query.replace(counter, "ray_silo_pfl_updates_left_out_never_made_total")
    assert [float(r["value"][1]) for r in _query(url, none_left_out, last)] == [0.0]


def _exprs(dashboard: dict[str, Any]) -> tuple[list[str], list[str]]:
    """The dashboard's panel queries (rows' panels included) and its variables' queries."""
    panels = list(dashboard["panels"])
    for panel in dashboard["panels"]:
        panels += panel.get("panels", [])
    exprs = [t["expr"] for p in panels for t in p.get("targets", [])]
    variables = [
        v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
        for v in dashboard["templating"]["list"]
        if v["type"] == "query"
    ]
    return exprs, variables


def _metric_names(expr: str) -> set[str]:
    """The silo_pfl metrics an expression reads: Ray's prefix and Prometheus' suffixes off."""
    names = re.findall(r"\bray_(silo_pfl_\w+)", expr)
    return {re.sub(r"_(total|bucket|sum|count)$", "", name) for name in names}


def test_every_panel_reads_an_exported_metric_and_every_metric_has_a_panel():
    dashboard = json.loads(DASHBOARD.read_text())
    exprs, variables = _exprs(dashboard)
    assert exprs
    used = set()
    for expr in exprs + variables:
        names = _metric_names(expr)
        assert names, f"reads no silo_pfl metric: {expr}"
        assert names <= METRIC_NAMES, f"not exported: {sorted(names - METRIC_NAMES)} in {expr}"
        assert "$federation" in expr or expr.startswith("label_values(ray_silo_pfl_round,")
        used |= _metric_names(expr) if expr in exprs else set()
    assert used == METRIC_NAMES, f"no panel for {sorted(METRIC_NAMES - used)}"
    templating = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert {"federation", "run_id"} <= set(templating)
    assert templating["datasource"]["type"] == "datasource"
    assert templating["datasource"]["query"] == "prometheus"
    for target in (t for p in dashboard["panels"] for t in p.get("targets", [])):
        assert target["datasource"]["uid"] == "${datasource}"
    # With several runs selected, a per-silo line is one run's: grouped and named by run too.
    for target in (t for p in dashboard["panels"] for t in p.get("targets", [])):
        for grouping in re.findall(r"\bby \(([^)]*)\)", target["expr"]):
            if "silo" in grouping:
                assert "run_id" in grouping, target["expr"]
                assert "{{run_id}}" in target["legendFormat"], target


@pytest.mark.parametrize(
    ("overrides", "ray_address_env", "on"),
    [
        ((), None, False),
        ((), "10.0.0.1:6379", True),
        (("ray.address=auto",), None, True),
        (("metrics.enabled=true",), None, True),
        (("metrics.enabled=false", "ray.address=auto"), None, False),
    ],
)
def test_metrics_are_on_when_a_run_joins_a_cluster_and_off_for_a_local_run(
    monkeypatch, overrides, ray_address_env, on
):
    if ray_address_env is None:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
    else:
        monkeypatch.setenv("RAY_ADDRESS", ray_address_env)
    cfg = load_config("jobs/heart_disease.yaml", list(overrides))
    assert metrics_enabled(cfg) is on
    assert local_options(cfg.ray)["include_dashboard"] is False  # never: see runtime/discovery


def test_a_local_run_without_metrics_hands_out_no_tags_and_creates_no_metric_object(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    _instruments.cache_clear()
    recorder, tags = driver_metrics(load_config("jobs/heart_disease.yaml"), "r1")
    assert tags is None and isinstance(recorder, NoMetrics)
    recorder.fits({"a": 1.0, "b": 3.0})
    recorder.left_out({"a": "late"})
    recorder.round(1, 2.0, 2)
    recorder.settle()
    recorder.linger()
    assert _instruments.cache_info().currsize == 0
    on = load_config("jobs/heart_disease.yaml", ["metrics.enabled=true"])
    recorder, tags = driver_metrics(on, "r1")
    assert tags == {"federation": "heart_disease", "run_id": "r1", "algorithm": "fedper"}
    assert not isinstance(recorder, NoMetrics)


@pytest.mark.usefixtures("ray_local")
def test_a_finished_runs_driver_series_are_held_no_longer(job):
    """A driver process that goes on after a run (a notebook, a script of several runs) holds
    that run's gauges no longer: Ray's agent drops them, and Grafana does not show a finished
    run at its last round with its silos alive for as long as the process lives."""
    from silo_pfl.federation import Federation
    from silo_pfl.runtime import metrics

    on = ("rounds=1", "metrics.enabled=true", "tracking.enabled=false")
    result = Federation(job("jobs/heart_disease.yaml", *on)).run()
    held = [name for name, tags in metrics._HELD.values if ("run_id", result.run_id) in tags]
    assert held == []
    recorder, _ = driver_metrics(load_config("jobs/heart_disease.yaml", list(on)), "r2")
    recorder.round(1, 0.5, 4)
    other = {"federation": "other", "run_id": "r3", "algorithm": "fedavg"}
    metrics._set("silo_pfl_round", 7, other)
    assert {tags for _, tags in metrics._HELD.values} >= {tuple(sorted(recorder.tags.items()))}
    recorder.close()
    assert [dict(tags)["run_id"] for _, tags in metrics._HELD.values] == ["r3"]
    metrics._HELD.forget(other)
