"""A round's evaluations (each with its commit) and the next round's fits go to each worker with
the aggregation: its silos start fitting round r+1 as soon as they have evaluated round r, while
the driver still ends round r (selection, the server's checkpoint, the callbacks). Under secure
aggregation a fit needs its round's keys and shares first: round r+1's are exchanged behind the
silos' evaluations of round r, and its fits are sent then, before the driver ends round r."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from silo_pfl.callbacks import Callback
from silo_pfl.federation import Federation
from silo_pfl.selection import Selector

pytestmark = pytest.mark.usefixtures("ray_local")

WAIT_S = 20.0  # how long round 1's end waits for round 2's fits to start
SMALL = (
    "jobs/digits_label_skew.yaml",
    "tracking.enabled=false",
    "data.num_silos=4",
    "data.classes_per_silo=3",
    "rounds=3",
    "train.local_epochs=1",
)


def await_fits(markers: Path, round_: int, count: int) -> list[str]:
    """The markers of round `round_`'s fits, once there are `count` of them or WAIT_S passed."""
    deadline = time.monotonic() + WAIT_S
    while True:
        started = sorted(p.name for p in markers.glob(f"fit-{round_}-*"))
        if len(started) == count or time.monotonic() > deadline:
            return started
        time.sleep(0.05)


class AwaitNextFits(Callback):
    """At round 1's end, waits (up to WAIT_S) for every silo's fit of round 2 to have begun."""

    def __init__(self, markers: Path) -> None:
        self.markers = markers
        self.started: list[str] = []
        self.silos: list[str] = []

    def on_start(self, config, silos, split) -> None:
        self.silos = sorted(info.silo for info in silos)

    def on_round_end(self, summary) -> None:
        if summary.round == 1:
            self.started = await_fits(self.markers, 2, len(self.silos))


@pytest.mark.parametrize("secure", [False, True], ids=["in-the-clear", "secure"])
def test_the_next_rounds_fits_run_while_the_driver_ends_a_round(job, tmp_path, secure):
    """Round 2's fits begin while the driver has not yet ended round 1. Under secure
    aggregation that means round 2's keys were advertised and its shares exchanged by then; every
    round still aggregates all four silos, at its first attempt."""
    markers = tmp_path / "markers"
    markers.mkdir()
    watch = AwaitNextFits(markers)
    config = job(
        *SMALL,
        f"aggregation.secure={str(secure).lower()}",
        "plugins=[tests.fit_markers]",
        "algorithm.name=mark_fits",
        f"algorithm.mark_fits.marker_dir={markers}",
    )
    result = Federation(config, callbacks=[watch]).run()
    assert watch.started == [f"fit-2-{silo}" for silo in watch.silos]
    assert [len(s.participants) for s in result.history] == [4, 4, 4]
    assert all(s.attempts == 1 and not s.absent for s in result.history)


def test_the_next_fits_begin_before_the_driver_has_chosen_among_the_evaluations(
    job, tmp_path, monkeypatch
):
    """A silo commits its round with its evaluation and goes on to its next fit: the driver's
    selection, which the choice of each silo's model waits for, is not on the silos' path."""
    markers = tmp_path / "markers"
    markers.mkdir()
    seen: list[list[str]] = []
    choose = Selector.choose

    def choose_once_the_next_fits_began(self, evals, unselected=()):
        if evals and evals[0].round == 1:
            seen.append(await_fits(markers, 2, len(evals)))
        return choose(self, evals, unselected)

    monkeypatch.setattr(Selector, "choose", choose_once_the_next_fits_began)
    config = job(
        *SMALL,
        "plugins=[tests.fit_markers]",
        "algorithm.name=mark_fits",
        f"algorithm.mark_fits.marker_dir={markers}",
    )
    result = Federation(config).run()
    assert seen == [[f"fit-2-silo_{i}" for i in range(4)]]
    assert all(len(s.participants) == 4 for s in result.history)
    assert all(s.selected_round >= 1 for s in result.silos.values())


def test_a_rejected_update_leaves_its_silo_out_though_its_evaluation_was_sent(job, tmp_path):
    """Evaluations go out with the aggregation, before its report: a silo whose update the
    server rejects is evaluated too, but its evaluation does not count and it does not commit;
    it takes part again next round. Its fit's figures (the bytes it sent) are the round's."""
    config = job(
        *SMALL,
        "round.min_silos=3",
        "aggregation.max_update_norm=100",
        "plugins=[tests.fault_plugins]",
        "algorithm.name=shift_once",
        "algorithm.shift_once.silo=silo_1",
        "algorithm.shift_once.round=2",
    )
    result = Federation(config).run()
    first, second, third = result.history
    assert sorted(second.participants) == ["silo_0", "silo_2", "silo_3"]
    # Its update crossed the wire and was checked: its fit's figures stay, with no evaluation.
    assert sorted(second.silos) == ["silo_0", "silo_1", "silo_2", "silo_3"]
    assert second.silos["silo_1"]["bytes_sent"] == second.silos["silo_0"]["bytes_sent"] > 0
    assert "val_accuracy" not in second.silos["silo_1"] and "val_accuracy" in second.silos["silo_0"]
    assert "exceeds aggregation.max_update_norm=100" in second.absent["silo_1"]
    assert len(first.participants) == len(third.participants) == 4
    assert sorted(third.silos) == ["silo_0", "silo_1", "silo_2", "silo_3"]
    assert result.silos["silo_1"].rounds_taken_part == 2
