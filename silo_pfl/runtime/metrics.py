"""Live metrics through Ray's metrics endpoint (ray.util.metrics), recorded where the work is.

Silo actors record their training, traffic, accuracy and masking from the FitMetrics and
EvalMetrics their plain Silo returns; the server actor its unmasking from the RoundReport; the
driver the round, its straggler, the silos alive and the updates left out. Each process creates
its metric objects once (`_instruments`); a run without metrics creates none. Ray exports them
with its own `ray_` prefix (a counter with `_total`) on each node's metrics agent. A gauge's last
value is held, set again every half export interval, until the process ends (`_Held`); the
straggler's gauge holds only its latest silo.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any

from silo_pfl.config import FederationConfig, ray_address
from silo_pfl.messages import EvalMetrics, FitMetrics, RoundReport
from silo_pfl.runtime import scrapes

RUN_TAGS = ("federation", "run_id", "algorithm")
SILO_TAGS = (*RUN_TAGS, "silo")
SCRAPE_POLL_S = 0.05  # how often a lingering run looks for the scrape it waits for
# How often the rounds look at the endpoint's connections (a look reads the kernel's tables: a
# few ms). A scrape stays listed for a minute after it ended, so none is missed between looks.
LOOK_EVERY_S = 5.0


@dataclass(frozen=True)
class MetricSpec:
    """One metric: its name (before Ray's `ray_` prefix), kind, tags and meaning."""

    name: str
    kind: str  # gauge | counter
    tags: tuple[str, ...]
    description: str


METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("silo_pfl_round", "gauge", RUN_TAGS, "The last round finished."),
    MetricSpec(
        "silo_pfl_round_seconds", "gauge", RUN_TAGS, "Wall time of the last round, retries in."
    ),
    MetricSpec(
        "silo_pfl_straggler_seconds",
        "gauge",
        SILO_TAGS,
        "How long the last round waited for its slowest silo (tag silo): its training seconds "
        "minus the median of the fits that arrived.",
    ),
    MetricSpec("silo_pfl_silos_alive", "gauge", RUN_TAGS, "Silos whose process is running."),
    MetricSpec(
        "silo_pfl_updates_left_out",
        "counter",
        (*SILO_TAGS, "reason"),
        "Updates not aggregated; reason: late, died, failed, withheld, rejected or down.",
    ),
    MetricSpec(
        "silo_pfl_silo_train_seconds", "gauge", SILO_TAGS, "The silo's last fit, in seconds."
    ),
    MetricSpec(
        "silo_pfl_silo_fits",
        "counter",
        SILO_TAGS,
        "Fits the silo's process ran: the bytes counters over it are a round's, even across a "
        "restart or a resume, which start every counter of the process again.",
    ),
    MetricSpec("silo_pfl_silo_bytes_sent", "counter", SILO_TAGS, "Bytes of updates sent."),
    MetricSpec(
        "silo_pfl_silo_bytes_received",
        "counter",
        SILO_TAGS,
        "Bytes of global keys and broadcasts received (fit and evaluation).",
    ),
    MetricSpec(
        "silo_pfl_silo_val_accuracy",
        "gauge",
        SILO_TAGS,
        "Validation accuracy of the silo's personalized model, last round.",
    ),
    MetricSpec(
        "silo_pfl_silo_test_accuracy",
        "gauge",
        SILO_TAGS,
        "Test accuracy of the silo's personalized model, last round.",
    ),
    MetricSpec(
        "silo_pfl_secure_mask_seconds",
        "gauge",
        SILO_TAGS,
        "Masking the silo's last update (aggregation.secure).",
    ),
    MetricSpec(
        "silo_pfl_secure_unmask_seconds",
        "gauge",
        RUN_TAGS,
        "The server summing and decoding the last round's masked updates (aggregation.secure).",
    ),
)
METRIC_NAMES = frozenset(spec.name for spec in METRICS)


def metrics_enabled(cfg: FederationConfig) -> bool:
    """metrics.enabled, where None means on when the run joins a cluster, off for a local run."""
    if cfg.metrics.enabled is not None:
        return cfg.metrics.enabled
    return ray_address(cfg.ray.address) is not None


def export_interval(cfg: FederationConfig) -> float | None:
    """The export interval a run's Ray session is started with: metrics.export_interval_s when
    live metrics are on, None when they are off."""
    return cfg.metrics.export_interval_s if metrics_enabled(cfg) else None


def run_tags(cfg: FederationConfig, run_id: str) -> dict[str, str]:
    """The tags of every metric of a run."""
    return {"federation": cfg.name, "run_id": run_id, "algorithm": str(cfg.algorithm["name"])}


@cache
def _instruments() -> dict[str, Any]:
    """This process's metric objects, created once."""
    from ray.util.metrics import Counter, Gauge

    kinds = {"gauge": Gauge, "counter": Counter}
    return {s.name: kinds[s.kind](s.name, s.description, tag_keys=s.tags) for s in METRICS}


class _Held:
    """The last value of each gauge series this process set, set again every export interval
    by a daemon thread: Ray's metrics agent drops a gauge series that was not set within two
    export intervals (2 s), while Prometheus scrapes every 5 s, so a gauge set once a round
    would be missing from most scrapes, and its last value from the run's end."""

    def __init__(self) -> None:
        self.values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None

    def set(self, name: str, value: float, tags: Mapping[str, str], alone: bool) -> None:
        """Set and hold a series; `alone`: the gauge's other series are no longer held."""
        key = (name, tuple(sorted(tags.items())))
        with self.lock:
            if alone:
                self.values = {k: v for k, v in self.values.items() if k[0] != name}
            self.values[key] = value
            if self.thread is None:
                self.thread = threading.Thread(target=self._hold, name="metrics-hold", daemon=True)
                self.thread.start()
        _instruments()[name].set(value, tags=dict(tags))

    def forget(self, tags: Mapping[str, str]) -> None:
        """Hold no longer the series whose tags include `tags` (a run's): Ray's agent drops
        them two export intervals later."""
        with self.lock:
            self.values = {
                k: v for k, v in self.values.items() if not tags.items() <= dict(k[1]).items()
            }

    def _hold(self) -> None:
        while True:
            time.sleep(export_interval_s() / 2)
            with self.lock:
                held = list(self.values.items())
            for (name, tags), value in held:
                _instruments()[name].set(value, tags=dict(tags))


_HELD = _Held()


def _set(name: str, value: float, tags: Mapping[str, str], alone: bool = False) -> None:
    """Set a gauge series, and hold it (`_Held`) until this process ends or, for `alone`, the
    gauge is set again on other tags."""
    _HELD.set(name, float(value), tags, alone)


def _inc(name: str, value: float, tags: Mapping[str, str]) -> None:
    if value > 0:
        _instruments()[name].inc(float(value), tags=dict(tags))


class SiloMetrics:
    """Records a silo's figures, in its actor's process."""

    def __init__(self, tags: Mapping[str, str], silo: str) -> None:
        self.tags = {**tags, "silo": silo}

    def fit(self, metrics: FitMetrics) -> None:
        _set("silo_pfl_silo_train_seconds", metrics.train_seconds, self.tags)
        _inc("silo_pfl_silo_fits", 1, self.tags)
        _inc("silo_pfl_silo_bytes_sent", metrics.bytes_sent, self.tags)
        _inc("silo_pfl_silo_bytes_received", metrics.bytes_received, self.tags)
        if metrics.secure_seconds > 0:
            _set("silo_pfl_secure_mask_seconds", metrics.secure_seconds, self.tags)

    def evaluate(self, metrics: EvalMetrics) -> None:
        _set("silo_pfl_silo_val_accuracy", metrics.val_accuracy, self.tags)
        _set("silo_pfl_silo_test_accuracy", metrics.test_accuracy, self.tags)
        _inc("silo_pfl_silo_bytes_received", metrics.bytes_received, self.tags)


class ServerMetrics:
    """Records the server's figures, in its actor's process."""

    def __init__(self, tags: Mapping[str, str]) -> None:
        self.tags = dict(tags)

    def aggregated(self, report: RoundReport) -> None:
        if report.secure_seconds > 0:
            _set("silo_pfl_secure_unmask_seconds", report.secure_seconds, self.tags)


def local_metrics_port() -> int:
    """The metrics export port of this process's Ray node."""
    import ray

    here = ray.get_runtime_context().get_node_id()
    return next(int(n["MetricsExportPort"]) for n in ray.nodes() if n["NodeID"] == here)


def export_interval_s() -> float:
    """How often this process's figures reach its node's metrics agent (Ray floors it at 1 s)."""
    import ray

    return max(ray._config.metrics_report_interval_ms(), 1000) / 1000.0


class DriverMetrics:
    """Records the rounds on the driver; `settle` and `linger` keep the run up until its last
    figures are exported (and, on a local Ray, scraped)."""

    def __init__(self, tags: Mapping[str, str], linger_s: float) -> None:
        self.tags, self.linger_s = dict(tags), linger_s  # linger_s: 0 on a cluster
        self.last = time.monotonic()
        self.port: int | None = None  # the local metrics endpoint's, once known
        self.watched_since = 0.0  # when the run first looked at its connections
        self.looked = 0.0  # when it last looked
        # What the first look found: the kernel's leftovers of an earlier process on that port
        # (closed connections stay listed for a minute), not scrapes of this run.
        self.stale: frozenset[str] = frozenset()
        self.scraped = False  # a scrape of it was seen during the run (or cannot be told)

    def fits(self, train_seconds: Mapping[str, float]) -> None:
        """The fits that arrived: the slowest one's wait beyond the median."""
        if train_seconds:
            slowest = max(train_seconds, key=lambda name: train_seconds[name])
            wait = train_seconds[slowest] - statistics.median(train_seconds.values())
            _set("silo_pfl_straggler_seconds", wait, {**self.tags, "silo": slowest}, alone=True)

    def left_out(self, reasons: Mapping[str, str]) -> None:
        """Silo -> why its update was not aggregated (late, died, failed, withheld, ...)."""
        for silo, reason in reasons.items():
            _inc("silo_pfl_updates_left_out", 1, {**self.tags, "silo": silo, "reason": reason})

    def watch(self) -> None:
        """Once Ray is up (a local one has just written the service-discovery file, so that a
        Prometheus may find and scrape it from now): the first look at its metrics endpoint."""
        self._look()

    def round(self, round_: int, seconds: float, alive: int) -> None:
        _set("silo_pfl_round", round_, self.tags)
        _set("silo_pfl_round_seconds", seconds, self.tags)
        _set("silo_pfl_silos_alive", alive, self.tags)
        self.last = time.monotonic()
        if not self.scraped and self.last - self.looked >= LOOK_EVERY_S:
            self._look()

    def _look(self) -> dict[str, bool] | None:
        """On a local Ray: the scrape connections of its metrics endpoint now; remembers that
        one was seen (or that none can be seen: no /proc). Closed connections already listed at
        the first look (`watch`, else round 1) do not count."""
        if self.linger_s <= 0:
            return None
        first = self.port is None
        if first:
            self.port, self.watched_since = local_metrics_port(), time.monotonic()
        seen, self.looked = scrapes.connections(self.port), time.monotonic()
        if first and seen is not None:
            self.stale = frozenset(peer for peer, open_ in seen.items() if not open_)
        self.scraped = self.scraped or seen is None or bool(set(seen) - self.stale)
        return seen

    def _wait(self, seconds: float) -> None:
        time.sleep(max(0.0, self.last + seconds - time.monotonic()))

    def settle(self) -> None:
        """Before the actors stop: one export interval after the last figures, so that every
        process's last figures have reached its node's metrics agent (the model export and the
        callbacks' on_end after the last round usually take longer already)."""
        self._wait(export_interval_s())

    def linger(self) -> None:
        """Before the actors stop and the driver leaves Ray: its own last figures exported and,
        on a local Ray, the first scrape that starts after that has ended, or metrics.linger_s
        has passed. The actors hold their gauges until then: Ray's agent drops a gauge two
        export intervals after its process ends, sooner than a 5 s scrape comes.

        Nothing waits when nothing scrapes: no connection to the endpoint was seen during the
        run (the kernel lists a closed one for a minute), watched from Ray's start for at least
        two linger times, in which a Prometheus scraping every linger_s finds and scrapes it. Where
        connections cannot be seen (no /proc), the whole linger_s is waited. The run's end
        (callbacks' on_end: MLflow, the report) runs before this, inside that time. Ctrl-C
        ends the wait, and the run ends as it would have.
        """
        try:
            self._linger()
        except KeyboardInterrupt:  # Ctrl-C while only waiting for a scrape: the run is done
            return

    def _linger(self) -> None:
        interval = export_interval_s()
        self._wait(interval)
        if self.linger_s <= 0:
            return
        before = self._look()
        watched = time.monotonic() - self.watched_since
        if before is not None and not self.scraped and watched >= 2 * self.linger_s:
            return
        deadline = self.last + interval + self.linger_s
        print(
            f"metrics: waiting up to {max(0.0, deadline - time.monotonic()):.0f} s for a scrape "
            "of the last figures (metrics.linger_s; Ctrl-C ends the wait)",
            file=sys.stderr,
            flush=True,
        )
        if before is None:
            self._wait(interval + self.linger_s)
            return
        while time.monotonic() < deadline:
            if scrapes.finished_since(before, scrapes.connections(self.port) or {}):
                return
            time.sleep(SCRAPE_POLL_S)

    def close(self) -> None:
        """The run is over, however it ended: its series are no longer held, so that a driver
        process that goes on (a notebook, a script of several runs) does not export a finished
        run's round and silos alive for as long as it lives."""
        _HELD.forget(self.tags)


class NoMetrics(DriverMetrics):
    """metrics.enabled off: records nothing and creates no metric object."""

    def __init__(self) -> None:
        super().__init__({}, 0.0)

    def fits(self, train_seconds: Mapping[str, float]) -> None:
        pass

    def left_out(self, reasons: Mapping[str, str]) -> None:
        pass

    def round(self, round_: int, seconds: float, alive: int) -> None:
        pass

    def settle(self) -> None:
        pass

    def linger(self) -> None:
        pass

    def close(self) -> None:
        pass


def driver_metrics(
    cfg: FederationConfig, run_id: str
) -> tuple[DriverMetrics, dict[str, str] | None]:
    """The driver's recorder and the tags handed to the actors; (NoMetrics, None) when off."""
    if not metrics_enabled(cfg):
        return NoMetrics(), None
    tags = run_tags(cfg, run_id)
    local = ray_address(cfg.ray.address) is None
    return DriverMetrics(tags, cfg.metrics.linger_s if local else 0.0), tags
