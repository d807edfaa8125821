"""How a round's updates reach the server's sum: in the clear, or by secure aggregation.

Plain: the silos fit, the server aggregates. Secure (silo_pfl.secure): before the fit the
silos advertise signed keys and share sealed secrets, relayed through the server, which fixes
who may mask; after the fit the survivors sign the server's unmask request (the consistency
round), and with the threshold's signatures on it reveal the shares that unmask the sum. The driver
only relays: every message is signed or sealed between silos, or is a share the server may see.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from silo_pfl.messages import RoundReport
from silo_pfl.runtime.actors import call_many, get, picked

ROUND_TIMEOUT = "round.timeout_s"  # the deadline of every step of a round

log = logging.getLogger("silo_pfl.rounds")
# Given the round's report (or its ref), and the refs of the new global keys and broadcast.
Then = Callable[[Any, tuple[Any, Any]], None] | None


@dataclass
class Prepared:
    """What a round's fit starts from: each fitting silo's own input (None: every live silo
    fits, with none), who was lost on the way, and why the attempt cannot go on, if so."""

    inbox: dict[str, Any] | None = None
    absent: dict[str, str] = field(default_factory=dict)
    died: set[str] = field(default_factory=set)
    failure: str = ""


@dataclass
class Aggregated:
    """The server's report, the refs of its global keys and broadcast, and whose process died."""

    report: RoundReport
    inputs: tuple[Any, Any]
    died: set[str] = field(default_factory=set)


class PlainSteps:
    """Updates in the clear: nothing before the fit, one call to aggregate."""

    fits_alone = True  # a fit needs nothing from these steps: it can be sent ahead

    def __init__(self, server: Any, gather: Any, timeout: float) -> None:
        self.server, self.gather, self.timeout = server, gather, timeout

    def prepare(self, live: dict[str, Any], round_: int, attempt: int) -> Prepared:
        return Prepared()

    def aggregate(
        self, live: dict[str, Any], updates: list[Any], round_: int, then: Then = None
    ) -> Aggregated:
        """The server's sum of `updates` (`Shared` items of the workers' lists of updates, each
        list sent once). `then(verdict, inputs)` is called with the refs of the report's verdict
        (`RoundReport.verdict`), the new global keys and broadcast as soon as they exist, before
        the report is awaited, so that the next steps reach the silos without waiting for the
        driver."""
        picks, lists = picked(updates)
        call = self.server.aggregate.options(num_returns=4)
        report_ref, verdict, *inputs = call.remote(picks, *lists)
        if then is not None:
            then(verdict, (inputs[0], inputs[1]))
        report = get(report_ref, f"round {round_}: aggregation", self.timeout, key=ROUND_TIMEOUT)
        return Aggregated(report, (inputs[0], inputs[1]))


class SecureSteps(PlainSteps):
    """Bonawitz et al.'s steps around the fit: advertise, share keys, (mask), confirm, unmask."""

    fits_alone = False  # each fit needs its round's keys and its peers' shares

    def prepare(self, live: dict[str, Any], round_: int, attempt: int) -> Prepared:
        refs = call_many(live, "advertise", round_, attempt)
        adverts, absent, died = self.gather({n: r for n, (r,) in refs.items()}, self.timeout)
        what = f"round {round_}: secure enrolment"
        failure = get(
            self.server.enroll.remote(round_, attempt, list(adverts.values())),
            what,
            self.timeout,
            key=ROUND_TIMEOUT,
        )
        if failure:
            return Prepared({}, absent, died, failure)
        enrolled = {n: live[n] for n in adverts}
        refs = call_many(enrolled, "share_keys", list(adverts.values()))
        bundles, lost, gone = self.gather({n: r for n, (r,) in refs.items()}, self.timeout)
        absent.update({n: f"could not share keys: {r}" for n, r in lost.items()})
        routed = get(
            self.server.route.remote(list(bundles.values())),
            f"round {round_}: routing shares",
            self.timeout,
            key=ROUND_TIMEOUT,
        )
        if isinstance(routed, str):
            return Prepared({}, absent, died | gone, routed)
        return Prepared(routed, absent, died | gone)

    def aggregate(
        self, live: dict[str, Any], updates: list[Any], round_: int, then: Then = None
    ) -> Aggregated:
        """The masked sum, then its unmasking (`then` as for the plain sum, once the unmasking
        is sent: a silo's next call must not be queued before its reveal)."""
        first = super().aggregate(live, updates, round_)
        request = first.report.unmask
        if request is None:
            if then is not None:
                then(first.report.verdict(), first.inputs)
            return first
        survivors = {n: live[n] for n in request.survivors}
        refs = call_many(survivors, "confirm", request)
        signatures, absent, died = self.gather({n: r for n, (r,) in refs.items()}, self.timeout)
        signed = replace(request, signatures=tuple(sorted(signatures.items())))
        refs = call_many({n: live[n] for n in signatures}, "unmask", signed)
        reveals, lost, gone = self.gather({n: r for n, (r,) in refs.items()}, self.timeout)
        absent.update(lost)
        died |= gone
        for name, reason in sorted(absent.items()):
            log.warning("round %d: silo %s revealed no shares: %s", round_, name, reason)
        call = self.server.unmask.options(num_returns=4)
        report_ref, verdict, *inputs = call.remote(*reveals.values())
        if then is not None:
            then(verdict, (inputs[0], inputs[1]))
        report = get(report_ref, f"round {round_}: unmasking", self.timeout, key=ROUND_TIMEOUT)
        return Aggregated(report, (inputs[0], inputs[1]), died)
