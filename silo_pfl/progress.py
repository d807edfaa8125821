"""What the CLI shows while a federation runs: a progress bar on a terminal, plain lines elsewhere.

On a terminal the rounds are one tqdm bar (round, elapsed, ETA, mean validation accuracy, the
slowest silo). Anywhere else (a pipe, CI, a Ray Job's log) each round is one plain line with the
same figures, so logs stay readable. `--quiet` leaves it out; the final table is printed either way.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, TextIO

from silo_pfl.callbacks import Callback
from silo_pfl.config import FederationConfig
from silo_pfl.messages import SiloInfo, SplitInfo
from silo_pfl.results import FederationResult, RoundSummary

if TYPE_CHECKING:
    from tqdm import tqdm

BAR_FORMAT = "{desc} {n_fmt}/{total_fmt} |{bar}| {elapsed}<{remaining}{postfix}"
# A terminal that reports no size (a pty nobody sized, e.g. script(1)'s) gets this one; tqdm
# would draw nothing at size 0. $COLUMNS and $LINES, when set, win.
FALLBACK_SIZE = (100, 24)


def _clock(seconds: float) -> str:
    """Seconds as m:ss, or h:mm:ss from an hour on."""
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def slowest_silo(summary: RoundSummary) -> tuple[str, float] | None:
    """The silo that trained longest in this round, and its training seconds."""
    timed = {n: m["train_seconds"] for n, m in summary.silos.items() if "train_seconds" in m}
    if not timed:
        return None
    name = max(sorted(timed), key=lambda n: timed[n])
    return name, timed[name]


class ProgressPrinter(Callback):
    """Prints the split, progress over rounds, and a per-silo table at the end.

    `bar`: None draws a bar exactly when `stream` is a terminal; True or False forces it.
    """

    def __init__(self, stream: TextIO | None = None, bar: bool | None = None) -> None:
        self.stream = stream or sys.stdout
        self.use_bar = self.stream.isatty() if bar is None else bar
        self.bar: tqdm | None = None
        self.rounds = 0
        self.started = 0.0
        self.done_here = 0  # rounds run by this process (a resumed run skips the earlier ones)

    def _print(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def on_start(
        self, config: FederationConfig, silos: Sequence[SiloInfo], split: SplitInfo
    ) -> None:
        self.rounds = config.rounds
        self.started = time.monotonic()
        self._print(
            f"federation {config.name}: {len(silos)} silos, algorithm {config.algorithm['name']}, "
            f"model {config.model.name}, {config.rounds} rounds, seed {config.seed}"
        )
        self._print(
            f"split: {split.global_parameters} global / {split.local_parameters} local parameters;"
            f" {split.bytes_sent_per_round} bytes sent per silo per round"
        )

    def on_round_start(self, round_: int) -> None:
        if self.use_bar and self.bar is None:
            from tqdm import tqdm

            size = shutil.get_terminal_size(FALLBACK_SIZE)
            self.bar = tqdm(
                total=self.rounds,
                initial=round_ - 1,
                desc="round",
                file=self.stream,
                bar_format=BAR_FORMAT,
                ncols=size.columns,
                nrows=size.lines,
                leave=True,
            )

    def on_round_end(self, summary: RoundSummary) -> None:
        self.done_here += 1
        slowest = slowest_silo(summary)
        slow = f"slowest {slowest[0]} {slowest[1]:.2f}s" if slowest else "slowest -"
        val = f"{summary.mean_val_accuracy:.3f}" if summary.evaluated else "-"
        figures = f"val {val}  {slow}"
        if summary.attempts > 1:
            figures += f"  (attempt {summary.attempts})"
        if summary.restarted:  # each silo's why is logged once, as it happens (runtime.rounds)
            figures += f"  restarted: {', '.join(sorted(summary.restarted))}"
        if summary.absent:
            figures += f"  left out: {', '.join(sorted(summary.absent))}"
        if self.bar is not None:
            self.bar.set_postfix_str(figures, refresh=False)
            self.bar.update(1)
            return
        elapsed = time.monotonic() - self.started
        left = self.rounds - summary.round
        eta = elapsed / self.done_here * left
        width = len(str(self.rounds))
        self._print(
            f"round {summary.round:>{width}}/{self.rounds}  {summary.seconds:6.2f}s  "
            f"elapsed {_clock(elapsed)}  eta {_clock(eta)}  loss {summary.mean_train_loss:.4f}  "
            f"{figures}"
        )

    def on_end(self, result: FederationResult) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        header = f"{'silo':<14}{'train':>7}{'val':>6}{'test':>6}{'round':>7}{'val acc':>9}"
        header += f"{'test acc':>10}{'bytes/round':>13}"
        self._print("")
        self._print(header)
        for name, silo in result.silos.items():
            self._print(
                f"{name:<14}{silo.num_train:>7}{silo.num_val:>6}{silo.num_test:>6}"
                f"{silo.selected_round:>7}{silo.val_accuracy:>9.3f}{silo.test_accuracy:>10.3f}"
                f"{silo.bytes_sent_per_round:>13}"
            )
        self._print(
            f"mean test accuracy {result.mean_test_accuracy:.4f}  worst "
            f"{result.worst_test_accuracy:.4f}  std {result.std_test_accuracy:.4f}  "
            f"({result.wall_seconds:.1f}s)"
        )
