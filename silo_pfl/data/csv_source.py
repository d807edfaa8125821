"""One CSV file per silo: `data.paths` maps silo name -> file, in the order given.

Each file has a header row. Column `data.label_column` holds the class label, every other column
is a numeric feature (named by the header). The job declares the classes, `data.num_classes` = C,
and every label of every silo must be a class index 0..C-1 (written as 3 or 3.0): mapping strings
per file would give different class indices at different silos. A silo may hold only some of the
classes (label skew); each reports num_classes = C, so every silo builds the same model.

Each silo holds out data.test_fraction of its rows for test and data.val_fraction of the rest for
validation, both stratified by label and seeded. Features are normalised with the mean and std
(ddof=0; constant features keep std 1) of the silo's training rows before the validation carve
(with data.max_train_rows, of the training rows it keeps and the validation rows), recorded in
`Preprocessing` so the exported model answers on raw rows.
"""

from __future__ import annotations

import csv
import functools
import math
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from silo_pfl import node_env
from silo_pfl.config import DataConfig
from silo_pfl.data.base import SiloData, assemble, fit_preprocessing
from silo_pfl.data.partitioners import holdout
from silo_pfl.errors import ConfigError, DataError
from silo_pfl.seeding import numpy_rng

EXAMPLE = "data.paths.hospital_a=/data/a.csv"


@dataclass
class Params(DataConfig):
    """data.* of data.source=csv."""

    test_fraction: float = 0.25  # share of each silo's rows held out for test
    paths: dict[str, str] = field(default_factory=dict)  # silo name -> that silo's file
    label_column: str = "label"  # the column holding the class label
    # Required: the classes 0..num_classes-1 every silo's labels must lie in; a silo may hold
    # only some of them.
    num_classes: int | None = None


MAX_CLASSES = 100_000  # the head's outputs: a typo's extra digits would be allocated by every silo


def declared_classes(cfg: Params) -> int:
    """data.num_classes, which a CSV federation must declare as an integer >= 2."""
    if cfg.num_classes is None:
        raise ConfigError(
            "data.num_classes: required for data.source=csv; set it to the number of classes C "
            "(labels are 0..C-1), e.g. data.num_classes=2"
        )
    if not 2 <= cfg.num_classes <= MAX_CLASSES:
        raise ConfigError(
            f"data.num_classes: got {cfg.num_classes}, expected an integer from 2 to {MAX_CLASSES}"
        )
    return cfg.num_classes


def validate(cfg: Params) -> None:
    """Check that every silo has a path, that a label column is named, and the classes."""
    if not cfg.paths:
        raise ConfigError(f"data.paths: give one CSV path per silo, e.g. {EXAMPLE}")
    for silo, path in cfg.paths.items():
        if not str(silo).strip() or not isinstance(path, str) or not path.strip():
            raise ConfigError(
                f"data.paths.{silo}: got {path!r}, expected a silo name mapped to a CSV path, "
                f"e.g. {EXAMPLE}"
            )
    if not cfg.label_column.strip():
        raise ConfigError("data.label_column: got '', expected the name of the label column")
    declared_classes(cfg)


def encode_raw(rows: np.ndarray) -> np.ndarray:
    """Raw rows (n, d) of the header's feature columns are already the model's features."""
    rows = np.asarray(rows, dtype=np.float64)
    if rows.ndim != 2:
        raise DataError(f"csv raw rows: got shape {rows.shape}, expected (n, features)")
    return rows


def silo_names(cfg: Params) -> list[str]:
    """The keys of data.paths, in the order given."""
    return list(cfg.paths)


class _Table:
    """Reads one silo's CSV file and raises one-line DataErrors naming the silo and the file."""

    def __init__(
        self, silo: str, path: Path, label_column: str, num_classes: int | None = None
    ) -> None:
        self.silo, self.path, self.label_column = silo, path, label_column
        self.num_classes = num_classes

    def error(self, message: str) -> DataError:
        """A one-line DataError naming the silo and the file."""
        return DataError(f"silo {self.silo}, file {self.path}: {message}")

    def read(self) -> tuple[tuple[str, ...], np.ndarray, np.ndarray]:
        """Feature names, features (n, d) float64 and labels (n,) int64."""
        if self.path.is_dir():
            raise self.error(f"is a directory (set data.paths.{self.silo} to a CSV file)")
        if not self.path.is_file():
            raise self.error(f"not found (set data.paths.{self.silo} to an existing CSV file)")
        try:
            with self.path.open(newline="", encoding="utf-8-sig") as handle:
                read = self._read_whole(handle)
            if read is not None:
                return read
            with self.path.open(newline="", encoding="utf-8-sig") as handle:
                return self._parse(csv.reader(handle))
        except UnicodeDecodeError:
            raise self.error("is not a UTF-8 text file") from None
        except (OSError, csv.Error) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            raise self.error(f"cannot be read ({reason})") from None

    def _header(self, reader: Any) -> list[str]:
        """The header row's names. A refused header is named by its names only when none is a
        number: a file without a header row has its first example there, label and all."""
        header = [name.strip() for name in next(reader, [])]
        if not any(header):
            raise self.error("is empty; expected a header row, then one row per example")
        numbers = sum(_is_number(name) for name in header)
        if self.label_column not in header and numbers:
            raise self.error(
                f"has no label column {self.label_column!r} (data.label_column), and {numbers} "
                f"of the {len(header)} cells of its first line are numbers: it needs a header "
                "row naming its columns (values not shown)"
            )
        duplicates = sorted({name for name in header if header.count(name) > 1})
        if duplicates:
            shown = ", ".join(map(repr, duplicates)) if not numbers else "(values not shown)"
            raise self.error(f"repeats column name(s) {shown} in its header")
        if "" in header:
            raise self.error(
                f"column {header.index('') + 1} of its header has no name; name every column "
                "(pandas writes its row index so: to_csv(..., index=False) leaves it out)"
            )
        if self.label_column not in header:
            raise self.error(
                f"has no label column {self.label_column!r} (data.label_column); columns found: "
                f"{', '.join(map(repr, header))}"
            )
        if len(header) < 2:
            raise self.error(f"has only the label column {self.label_column!r}, no features")
        return header

    def _read_whole(self, handle: Any) -> tuple[tuple[str, ...], np.ndarray, np.ndarray] | None:
        """A well-formed file through numpy's C reader: a tenth of the time, and the table's own
        size in memory rather than ten times it as Python floats. None for any other file (a
        blank or ragged row, a value numpy does not read, one not finite, a label not a class),
        which `_parse` then reads cell by cell, to name the row and column."""
        header = self._header(csv.reader(handle))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # no data rows: _parse says so
                table = np.loadtxt(
                    handle, delimiter=",", comments=None, quotechar='"', ndmin=2, dtype=np.float64
                )
        except ValueError:
            return None
        if table.shape[0] == 0 or table.shape[1] != len(header) or not np.isfinite(table).all():
            return None
        label_at = header.index(self.label_column)
        if self._bad_labels(table[:, label_at]).any():
            return None
        names = tuple(name for name in header if name != self.label_column)
        return names, np.delete(table, label_at, axis=1), table[:, label_at].astype(np.int64)

    def _parse(self, reader: Any) -> tuple[tuple[str, ...], np.ndarray, np.ndarray]:
        header = self._header(reader)
        rows, lines = [], []
        for record in reader:
            if not any(cell.strip() for cell in record):
                continue
            if len(record) != len(header):
                raise self.error(
                    f"data row {len(rows) + 1} (line {reader.line_num}) has {len(record)} "
                    f"values, the header has {len(header)}"
                )
            rows.append(
                [
                    self._number(cell, name, len(rows) + 1, reader.line_num)
                    for cell, name in zip(record, header, strict=True)
                ]
            )
            lines.append(reader.line_num)
        if not rows:
            raise self.error("has a header but no data rows")
        table = np.asarray(rows, dtype=np.float64)
        label_at = header.index(self.label_column)
        labels = self._labels(table[:, label_at], lines)
        names = tuple(name for name in header if name != self.label_column)
        return names, np.delete(table, label_at, axis=1), labels

    def _allowed(self) -> str:
        """What a label may be: the declared class indices."""
        if self.num_classes is None:
            return "labels must be integers 0..C-1"
        top = self.num_classes - 1
        return f"labels must be integers 0..{top} (data.num_classes={self.num_classes})"

    def _number(self, cell: str, column: str, row: int, line: int) -> float:
        try:
            value = float(cell)
        except ValueError:
            value = float("nan")
        if not math.isfinite(value) and column == self.label_column:
            raise self.error(
                f"label column {column!r}, data row {row} (line {line}): not a class index; "
                f"{self._allowed()}"
            )
        if not math.isfinite(value):
            raise self.error(
                f"column {column!r}, data row {row} (line {line}): not a finite number"
            )
        return value

    def _bad_labels(self, values: np.ndarray) -> np.ndarray:
        """Which of `values` are no class index."""
        bad = (values < 0) | (values != np.round(values))
        if self.num_classes is not None:
            bad |= values >= self.num_classes
        return bad

    def _labels(self, values: np.ndarray, lines: list[int]) -> np.ndarray:
        bad = self._bad_labels(values)
        if bad.any():
            row = int(np.flatnonzero(bad)[0]) + 1
            raise self.error(
                f"label column {self.label_column!r}, data row {row} (line {lines[row - 1]}): "
                f"not a class index; {self._allowed()}"
            )
        return values.astype(np.int64)


def _is_number(cell: str) -> bool:
    """Whether a header cell reads as a number (nan and inf included)."""
    try:
        float(cell)
    except ValueError:
        return False
    return True


def read_silo_csv(
    silo: str, path: str | Path, label_column: str, num_classes: int | None = None
) -> tuple[tuple[str, ...], np.ndarray, np.ndarray]:
    """Feature names, raw features (n, d) float64 and labels (n,) int64 of one silo's file;
    with `num_classes`, every label must be below it."""
    return _Table(silo, node_path(silo, path), label_column, num_classes).read()


def node_path(silo: str, path: str | Path) -> Path:
    """The silo's path as its own node sees it: `~` and `$VARS` expanded from that node's
    environment (e.g. `$SILO_PFL_DATA_DIR/heart.csv`), so each node may keep its data elsewhere."""
    expanded, unset = node_env.expand(os.path.expanduser(str(path)))
    if unset:
        raise DataError(
            f"silo {silo}, file {path}: environment variable {unset} is not set on the node the "
            f"silo ran on; {node_env.pin_hint(silo)}"
        )
    return Path(expanded)


def load(cfg: Params, silo: str, seed: int) -> SiloData:
    """Read the silo's CSV, split test and validation rows, normalise with training statistics."""
    if silo not in cfg.paths:
        raise DataError(
            f"silo {silo}: not in data.paths; expected one of {', '.join(cfg.paths) or '(none)'}"
        )
    path = node_path(silo, cfg.paths[silo])
    num_classes = declared_classes(cfg)
    names, x, y = read_silo_csv(silo, path, cfg.label_column, num_classes)
    if len(y) < 2:
        raise DataError(
            f"silo {silo}, file {path}: has {len(y)} data row, need at least 2 to split into "
            "train and test (data.test_fraction)"
        )
    train, test = holdout(y, cfg.test_fraction, numpy_rng(seed, "test", silo))
    fit_normalisation = functools.partial(
        fit_preprocessing, names, where=f"silo {silo}, file {path}"
    )
    return assemble(
        silo,
        x,
        y,
        train,
        test,
        cfg.val_fraction,
        seed,
        source_file=path,
        preprocessing=fit_normalisation,
        max_train_rows=cfg.max_train_rows,
        num_classes=num_classes,
        raw_columns=names,
        x_test_raw=x[test],
    )
