"""The report's figures: matplotlib's object API on the Agg canvas (no pyplot, no global backend),
under matplotlib's built-in defaults, so the same run gives the same PNG anywhere."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from silo_pfl.report.data import RunData

if TYPE_CHECKING:
    from matplotlib.figure import Figure as MplFigure

DPI = 100
GAIN, LOSS, EVEN = "#2e7d32", "#c62828", "#9e9e9e"
VAL_COLOR, TEST_COLOR, OTHER_COLOR = "#1f77b4", "#ff7f0e", "#616161"
COLUMNS = 5  # small multiples per row
MAX_CELL_LABELS = 400  # the partition's counts are written in its cells up to this many
CHAR_INCHES = 0.085  # a character of 10-point text, on average, sized for the margins
FILES = ("accuracy.png", "gain.png", "spread.png", "bytes.png", "partition.png")


@dataclass(frozen=True)
class Figure:
    """One PNG of the report, with what the page says about it."""

    file: str
    title: str
    caption: str


@contextlib.contextmanager
def _defaults() -> Iterator[None]:
    """matplotlib's built-in rc settings, whatever the user's matplotlibrc says."""
    import matplotlib

    skip = {"backend", "backend_fallback", "interactive"}
    with matplotlib.rc_context(
        {k: v for k, v in matplotlib.rcParamsDefault.items() if k not in skip}
    ):
        yield


def _figure(
    width: float,
    height: float,
    margins: tuple[float, float, float, float],
    grid: tuple[int, int] = (1, 1),
    gaps: tuple[float, float] = (0.0, 0.0),
) -> MplFigure:
    """A figure of width x height inches whose axes, `grid` (rows, columns) of them, leave
    `margins` (left, right, top, bottom) and `gaps` (across, down) between them, in inches.
    Fixed, not constrained: the layout solver measures every text once more, which costs as much
    as drawing it."""
    from matplotlib.figure import Figure as MplFigure

    (left, right, top, bottom), (rows, cols), (gap_x, gap_y) = margins, grid, gaps
    cell_w = (width - left - right - (cols - 1) * gap_x) / cols
    cell_h = (height - top - bottom - (rows - 1) * gap_y) / rows
    fig = MplFigure(figsize=(width, height), dpi=DPI)
    fig.subplots_adjust(
        left=left / width,
        right=1 - right / width,
        top=1 - top / height,
        bottom=bottom / height,
        wspace=gap_x / cell_w,
        hspace=gap_y / cell_h,
    )
    return fig


def _text_inches(labels: Iterable[str], points: float = 10) -> float:
    """About how wide the longest of `labels` is, in inches, at `points` (DejaVu Sans)."""
    return max((len(label) for label in labels), default=0) * CHAR_INCHES * points / 10


def _save(fig: MplFigure, path: Path) -> None:
    fig.savefig(path, format="png", dpi=DPI, metadata={"Software": None})


def _grid(n: int) -> tuple[int, int]:
    cols = min(COLUMNS, n)
    return math.ceil(n / cols), cols


def _small_multiples(n: int, width: float, height: float) -> tuple[MplFigure, list[Any]]:
    """A figure of n axes (width x height inches each), COLUMNS a row, sharing x and y."""
    rows, cols = _grid(n)
    left, right, top, bottom, gap_x, gap_y = 1.0, 0.2, 0.75, 0.65, 0.3, 0.5
    fig_w = left + right + cols * width + (cols - 1) * gap_x
    fig_h = top + bottom + rows * height + (rows - 1) * gap_y
    fig = _figure(fig_w, fig_h, (left, right, top, bottom), (rows, cols), (gap_x, gap_y))
    axes = np.atleast_1d(fig.subplots(rows, cols, sharex=True, sharey=True)).ravel()
    for ax in axes[n:]:
        ax.set_visible(False)
    return fig, list(axes[:n])


def accuracy_figure(run: RunData) -> MplFigure:
    """`accuracy`'s figure. A silo's lines break at the evaluated rounds it missed (left out,
    lost), where a line across them would show values it never had."""
    from matplotlib.ticker import FixedLocator, MaxNLocator

    evaluated = sorted({r for silo in run.silos.values() for r in silo.rounds})
    fig, axes = _small_multiples(len(run.silos), 2.8, 1.9)
    # A dot on every point, small beyond 20 rounds: a point between missed rounds (a line of
    # one point) shows only as its dot.
    size = 6.0 if run.rounds <= 20 else 2.0
    for ax, silo in zip(axes, run.silos.values(), strict=True):
        for values, color in ((silo.val_accuracy, VAL_COLOR), (silo.test_accuracy, TEST_COLOR)):
            at = dict(zip(silo.rounds, values, strict=True))
            y = [at.get(r, math.nan) for r in evaluated]
            ax.plot(evaluated, y, color=color, marker=".", markersize=size, lw=1.2)
        chosen = silo.selected_round
        title = f"{silo.name}: no selection"
        if chosen is not None:
            ax.axvline(chosen, color=OTHER_COLOR, ls=":", lw=1)
            ax.plot([chosen], [silo.selected_test_accuracy], "o", color=TEST_COLOR, mec="black")
            title = f"{silo.name}: {silo.selected_test_accuracy:.3f} @ round {chosen}"
        # y given: matplotlib then skips placing each title by its axes' tick labels.
        ax.set_title(title, y=1.0, fontsize=10)
        ax.set_ylim(0, 1.02)
        ax.yaxis.set_major_locator(FixedLocator([0, 0.25, 0.5, 0.75, 1.0]))
        ax.xaxis.set_major_locator(MaxNLocator(nbins=5, integer=True))
        ax.grid(alpha=0.3)
    fig.supxlabel("round")
    fig.supylabel("accuracy")
    # Two short lines, wrapped further on a narrow figure (one or two silos): the caption under
    # the figure says the rest.
    fig.suptitle(
        f"{run.federation} / {run.algorithm}: accuracy per silo\n"
        "blue validation, orange test; dotted: the selected round",
        fontsize=11,
        wrap=True,
    )
    return fig


def accuracy(run: RunData, out: Path) -> Figure:
    """Per silo: validation and test accuracy over rounds, the selected round marked."""
    with _defaults():
        _save(accuracy_figure(run), out / "accuracy.png")
    return Figure(
        "accuracy.png",
        "Accuracy over rounds",
        "Each silo's personalized model on its own validation (blue) and test (orange) rows, "
        "per round; the dotted line and the dot mark the round whose model the silo kept "
        "(chosen on validation accuracy only).",
    )


def gain(run: RunData, against: RunData, out: Path) -> Figure:
    """Per silo: selected test accuracy in `run` minus in `against`, sorted, green or red; of
    the silos that selected a model in both."""
    common = [s for s in run.selected if s in against.selected]
    gains = {
        s: 100 * (run.silos[s].selected_test_accuracy - against.silos[s].selected_test_accuracy)
        for s in common
    }
    order = sorted(common, key=lambda s: (gains[s], s))
    values = [gains[s] for s in order]
    colors = [GAIN if v > 0 else LOSS if v < 0 else EVEN for v in values]
    with _defaults():
        margins = (0.6 + _text_inches(order), 0.3, 0.45, 0.6)
        fig = _figure(8, 0.42 * len(order) + 1.6, margins)
        ax = fig.add_subplot()
        ax.barh(order, values, color=colors)
        ax.axvline(0, color="black", lw=0.8)
        span = max([abs(v) for v in values] + [1.0])
        for y, v in enumerate(values):
            ax.text(
                v + (0.01 if v >= 0 else -0.01) * span,
                y,
                f"{v:+.1f}",
                va="center",
                ha="left" if v >= 0 else "right",
                fontsize=9,
            )
        ax.set_xlim(-1.2 * span if min(values) < 0 else -0.05 * span, 1.2 * span)
        ax.set_xlabel("gain in selected test accuracy (percentage points)")
        ax.set_ylabel("silo")
        ax.grid(axis="x", alpha=0.3)
        won = sum(v > 0 for v in values)
        lost = sum(v < 0 for v in values)
        ax.set_title(
            f"{run.algorithm} over {against.algorithm} (run {against.run_id[:8]}): "
            f"{won} silos gained, {lost} lost, {len(values) - won - lost} even"
        )
        _save(fig, out / "gain.png")
    return Figure(
        "gain.png",
        f"Gain over {against.algorithm}",
        f"Each silo's selected test accuracy in this run minus in run {against.run_id} "
        f"({against.algorithm}), in percentage points, sorted: green gained, red lost.",
    )


def spread(run: RunData, against: RunData | None, out: Path) -> Figure:
    """Selected test accuracy per silo, sorted, with the mean, the worst and mean ± std."""
    ordered = sorted(run.silos.values(), key=lambda s: (s.selected_test_accuracy, s.name))
    names = [s.name for s in ordered]
    values = [s.selected_test_accuracy for s in ordered]
    mean, worst, std = run.mean_test, run.worst_test, run.std_test
    legend = [f"{run.algorithm} (this run)", "mean ± std", f"worst {worst:.3f}"]
    if against is not None:
        legend.append(f"{against.algorithm} (run {against.run_id[:8]})")
    with _defaults():
        margins = (0.6 + _text_inches(names), 0.45 + _text_inches(legend, 8), 0.45, 0.6)
        fig = _figure(9, 0.42 * len(names) + 1.8, margins)
        ax = fig.add_subplot()
        ax.axvspan(mean - std, mean + std, color=TEST_COLOR, alpha=0.12, label="mean ± std")
        ax.hlines(names, 0, values, color=TEST_COLOR, lw=2)
        ax.plot(values, names, "o", color=TEST_COLOR, ms=8, label=f"{run.algorithm} (this run)")
        ax.axvline(mean, color="black", lw=1.2, label=f"mean {mean:.3f}")
        ax.axvline(worst, color=LOSS, lw=1.2, ls="--", label=f"worst {worst:.3f}")
        if against is not None:
            other = [
                against.silos[n].selected_test_accuracy if n in against.silos else np.nan
                for n in names
            ]
            ax.plot(
                other,
                names,
                "D",
                mfc="white",
                mec=OTHER_COLOR,
                label=f"{against.algorithm} (run {against.run_id[:8]})",
            )
        ax.set_xlim(0, 1.0)
        ax.set_xlabel("selected test accuracy")
        ax.set_ylabel("silo")
        ax.grid(axis="x", alpha=0.3)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
        ax.set_title(f"Spread across silos: mean {mean:.3f}, worst {worst:.3f}, std {std:.3f}")
        _save(fig, out / "spread.png")
    return Figure(
        "spread.png",
        "Spread across silos (fairness)",
        "Each silo's selected test accuracy, sorted; the black line is the mean over silos, the "
        "dashed red line the worst silo, the band mean ± one standard deviation"
        + ("; white diamonds: the compared run." if against is not None else "."),
    )


def full_model_bytes(split: dict[str, Any]) -> tuple[int, str]:
    """What full-model FedAvg sends per silo per round: every state_dict entry (split.json's
    model_bytes), or float32 parameters for a run logged before model_bytes existed."""
    if split.get("model_bytes"):
        return int(split["model_bytes"]), "every state_dict entry"
    params = int(split.get("global_parameters") or 0) + int(split.get("local_parameters") or 0)
    return 4 * params, "float32 parameters"


def _unit(largest: float) -> tuple[float, str]:
    """A binary unit in which `largest` bytes reads well."""
    for scale, unit in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if largest >= scale:
            return float(scale), unit
    return 1.0, "bytes"


def traffic(run: RunData, against: RunData | None, out: Path) -> Figure | None:
    """Bytes per silo per round, and cumulated over silos and rounds, against full-model FedAvg."""
    if run.split.get("bytes_sent_per_round") is None:
        return None
    from matplotlib.ticker import MaxNLocator

    full, basis = full_model_bytes(run.split)
    sent = int(run.split["bytes_sent_per_round"])
    bars = {f"{run.algorithm}\n(this run)": sent}
    if against is not None and against.split.get("bytes_sent_per_round") is not None:
        bars[f"{against.algorithm}\n(run {against.run_id[:8]})"] = int(
            against.split["bytes_sent_per_round"]
        )
    bars["full-model\nFedAvg"] = full
    rounds = sorted({r for s in run.silos.values() for r in s.bytes_sent})
    per_round = [sum(s.bytes_sent.get(r, 0.0) for s in run.silos.values()) for r in rounds]
    with _defaults():
        fig = _figure(11, 4, (0.75, 0.2, 0.65, 0.7), grid=(1, 2), gaps=(0.5, 0.0))
        left, right = fig.subplots(1, 2, width_ratios=[1, 1.4])
        scale, unit = _unit(max(bars.values()))
        heights = [v / scale for v in bars.values()]
        colors = [TEST_COLOR] + [OTHER_COLOR] * (len(bars) - 2) + ["#455a64"]
        left.bar(list(bars), heights, color=colors)
        for x, v in enumerate(bars.values()):
            share = f" ({100 * v / full:.0f}%)" if full else ""
            text = f"{v / scale:,.1f} {unit}{share}"
            left.text(x, v / scale, text, ha="center", va="bottom", fontsize=9)
        left.set_ylabel(f"{unit} sent per silo per round")
        left.set_ylim(0, 1.15 * max([*heights, 1e-9]))
        left.set_title("One silo, one round")
        cumulated = np.cumsum(per_round)
        full_line = np.array([full * len(run.silos) * r for r in rounds], dtype=float)
        scale, unit = _unit(max([*full_line, *cumulated, 1.0]))
        label = f"{run.algorithm}: sent by all silos"
        right.plot(rounds, cumulated / scale, color=TEST_COLOR, label=label)
        label = "full-model FedAvg, every silo every round"
        right.plot(rounds, full_line / scale, color="#455a64", ls="--", label=label)
        right.set_xlabel("round")
        right.set_ylabel(f"{unit} sent, cumulated")
        right.set_ylim(bottom=0)
        right.xaxis.set_major_locator(MaxNLocator(integer=True))
        right.set_title("All silos, cumulated over rounds")
        right.grid(alpha=0.3)
        right.legend(fontsize=8)
        fig.suptitle(f"Bytes on the wire: {run.algorithm} against full-model FedAvg ({basis})")
        _save(fig, out / "bytes.png")
    secure = " Under secure aggregation a silo sends masked 64-bit words." if run.secure else ""
    return Figure(
        "bytes.png",
        "Bytes per round",
        f"What one silo sends per round (the global layers), against full-model FedAvg "
        f"({full:,} bytes: {basis}); right, the bytes all silos sent, cumulated.{secure}",
    )


def partition(run: RunData, out: Path) -> Figure | None:
    """Per silo, a row: its training rows per class (as the silo counted them), shaded and
    written in each cell (beyond MAX_CELL_LABELS cells, shaded only: darker is more)."""
    if not run.partition:
        return None
    names = [s for s in run.silos if s in run.partition] or list(run.partition)
    classes = max(len(c) for c in run.partition.values())
    counts = np.array([run.partition[n] + [0] * (classes - len(run.partition[n])) for n in names])
    with _defaults():
        rows = [f"{n} ({t})" for n, t in zip(names, counts.sum(1), strict=True)]
        margins = (0.6 + _text_inches(rows), 0.2, 0.75, 0.6)
        fig = _figure(max(6.0, 1.6 + 0.55 * classes), 1.6 + 0.42 * len(names), margins)
        ax = fig.add_subplot()
        ax.imshow(counts, cmap="Blues", aspect="auto", vmin=0)
        if counts.size <= MAX_CELL_LABELS:
            dark = counts.max() * 0.6
            for (row, col), value in np.ndenumerate(counts):
                color = "white" if value > dark else "black"
                ax.text(col, row, str(value), ha="center", va="center", color=color, fontsize=8)
        ax.set_xticks(range(classes))
        ax.set_yticks(range(len(names)), rows)
        ax.set_xlabel("class")
        ax.set_ylabel("silo (its training rows)")
        ax.set_title(f"{run.federation}: the partition\ntraining rows per class in each silo")
        _save(fig, out / "partition.png")
    return Figure(
        "partition.png",
        "The partition",
        "Each row is a silo's label histogram: its training rows per class. Each silo counted "
        "its own rows and reported only these counts; no row left it.",
    )


def draw(run: RunData, against: RunData | None, out: Path) -> list[Figure]:
    """Every figure that applies to the run, written as PNGs into `out`."""
    figures = [accuracy(run, out)]
    if against is not None:
        figures.append(gain(run, against, out))
    figures.append(spread(run, against, out))
    figures += [f for f in (traffic(run, against, out), partition(run, out)) if f is not None]
    return figures
