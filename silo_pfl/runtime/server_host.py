"""The server's Ray actor. Its module imports no torch, nor anything that does, so that the
server's worker process starts in a fraction of a silo worker's time (a test checks it)."""

from __future__ import annotations

import gc
from collections.abc import Sequence
from typing import Any

import ray

from silo_pfl.messages import RoundReport, SiloUpdate, Verdict
from silo_pfl.runtime import huge_pages
from silo_pfl.runtime.metrics import ServerMetrics
from silo_pfl.secure.aggregator import SecureRoundError
from silo_pfl.secure.messages import Advertisement, Reveal, SealedShares
from silo_pfl.server import Server, ServerStart


class ServerHost:
    """The server in a Ray worker: it starts as soon as the run does, and is built once the
    silos have told the driver their input shape and classes and the driver has made the
    server's start from them. Like a silo worker it is opened for a run and closed after it."""

    def __init__(self) -> None:
        huge_pages.no_advice()
        self.config: dict[str, Any] = {}
        self.run_id = ""
        self.metrics: ServerMetrics | None = None
        self.server: Any = None

    def open(
        self,
        config: dict[str, Any],
        run_id: str = "default",
        metric_tags: dict[str, str] | None = None,
    ) -> None:
        self.config, self.run_id, self.server = config, run_id, None
        self.metrics = ServerMetrics(metric_tags) if metric_tags is not None else None

    def close(self) -> None:
        if self.server is not None:
            self.server.release()
        self.config, self.server, self.metrics = {}, None, None
        gc.collect()

    def build(self, start: ServerStart) -> None:
        self.server = Server(self.config, start, self.run_id)

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def global_state(self) -> Any:
        return self.server.global_state()

    def broadcast(self) -> Any:
        return self.server.broadcast()

    def aggregate(
        self, picks: Sequence[tuple[int, int]], *lists: Sequence[SiloUpdate]
    ) -> tuple[RoundReport, Verdict, Any, Any]:
        """The round's report on the updates `picks` names (item i of list a, for each (a, i):
        a worker's silos' updates come as one list, `actors.picked`), and what the next steps
        read (call with num_returns=4): the report's verdict, which the silos are given, and the
        global keys and the strategy's broadcast as they now are, aggregated or not."""
        return self._reported(self.server.aggregate(*(lists[a][i] for a, i in picks)))

    def unmask(self, *reveals: Reveal) -> tuple[RoundReport, Verdict, Any, Any]:
        """Secure aggregation's last step; returns like `aggregate`."""
        return self._reported(self.server.unmask(*reveals))

    def _reported(self, report: RoundReport) -> tuple[RoundReport, Verdict, Any, Any]:
        if self.metrics is not None and report.unmask is None:
            self.metrics.aggregated(report)
        return report, report.verdict(), self.server.global_state(), self.server.broadcast()

    def enroll(self, round_: int, attempt: int, adverts: list[Advertisement]) -> str:
        """Secure aggregation, step 1; '' or why the attempt cannot go on."""
        try:
            self.server.enroll(round_, attempt, adverts)
        except SecureRoundError as exc:
            return str(exc)
        return ""

    def route(self, bundles: list[SealedShares]) -> dict[str, dict[str, bytes]] | str:
        """Secure aggregation, step 2: the silos' inboxes, or why the attempt cannot go on."""
        try:
            return self.server.route(bundles)
        except SecureRoundError as exc:
            return str(exc)

    def checkpoint(self, round_: int, driver: dict[str, Any]) -> None:
        self.server.checkpoint(round_, driver)

    def resume(self, before: int | None = None) -> dict[str, Any]:
        return self.server.resume(before)

    def state_bytes(self, round_: int | None = None) -> bytes:
        return self.server.state_bytes(round_)
