"""The one structure a data source hands to a silo: its own train, validation and test arrays."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from silo_pfl.errors import DataError


@dataclass(frozen=True)
class Preprocessing:
    """Feature preprocessing fitted on the silo's own training rows, applied as (x - mean) / std.

    It travels with the silo's exported model so that the model answers on raw feature rows.
    An empty `mean` means the inputs need no preprocessing beyond what the source did.
    """

    feature_names: tuple[str, ...] = ()
    mean: tuple[float, ...] = ()
    std: tuple[float, ...] = ()

    def apply(self, x: np.ndarray) -> np.ndarray:
        """Normalise raw feature rows the way the silo's training rows were normalised."""
        if not self.mean:
            return x.astype(np.float32)
        return ((x - np.asarray(self.mean)) / np.asarray(self.std)).astype(np.float32)


def fit_preprocessing(
    names: tuple[str, ...], features: np.ndarray, ddof: int = 0, where: str = ""
) -> Preprocessing:
    """Mean and std (with `ddof`) of a silo's training rows; a constant feature, or too few rows
    for a std, keeps std 1. A constant feature is one whose rows are all equal (its float std
    may be 4e-17 rather than 0): its mean is that value, so its training rows become exactly 0.
    A column whose values are too large for them to be finite in float64 is a DataError naming
    it (`where`: the silo and its file), never a value."""
    with np.errstate(over="ignore", invalid="ignore"):
        mean = features.mean(axis=0)
        std = (
            features.std(axis=0, ddof=ddof) if len(features) > ddof else np.zeros(features.shape[1])
        )
    wild = ~(np.isfinite(mean) & np.isfinite(std))
    if wild.any():
        column = names[int(np.argmax(wild))] if len(names) == len(wild) else int(np.argmax(wild))
        raise DataError(
            f"{where or 'data'}: column {column!r}: its values are too large to standardise (their "
            "mean and spread overflow float64); rescale the column, e.g. to other units"
        )
    if len(features):
        constant = features.max(axis=0) == features.min(axis=0)
        mean = np.where(constant, features[0], mean)
        std = np.where(constant, 0.0, std)
    return Preprocessing(
        feature_names=names,
        mean=tuple(float(v) for v in mean),
        std=tuple(float(v) for v in np.where(std > 0, std, 1.0)),
    )


@dataclass(frozen=True)
class SiloData:
    """A silo's private data, already split. Inputs are float32, labels int64 class indices."""

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_val: np.ndarray
    y_val: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    # Training rows before the validation hold-out was carved from them.
    num_train_total: int
    preprocessing: Preprocessing = field(default_factory=Preprocessing)
    # The raw layout a served model answers on: its column names, and the test rows in it.
    # The source's `encode_raw` then `preprocessing.apply` turn raw rows into x_test exactly.
    raw_columns: tuple[str, ...] = ()
    x_test_raw: np.ndarray | None = None

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one input example."""
        return tuple(self.x_train.shape[1:])

    def validation_digest(self) -> str:
        """A SHA-256 of the validation rows as the model sees them (inputs and labels, with their
        dtypes and shapes): two validation accuracies compare only when their digests match."""
        return _digest(self.x_val, self.y_val)

    def digest(self) -> str:
        """A SHA-256 of every row as the model sees them, train, validation and test: a silo
        resumes only on the data it committed its rounds on."""
        return _digest(self.x_train, self.y_train, self.x_val, self.y_val, self.x_test, self.y_test)

    def __post_init__(self) -> None:
        for split in ("train", "val", "test"):
            x, y = getattr(self, f"x_{split}"), getattr(self, f"y_{split}")
            if len(x) != len(y):
                raise ValueError(f"silo {self.name}: {split} has {len(x)} inputs, {len(y)} labels")
        raw = self.x_test_raw
        if raw is not None and raw.shape != (len(self.y_test), len(self.raw_columns)):
            raise ValueError(
                f"silo {self.name}: raw test rows {raw.shape}, expected "
                f"({len(self.y_test)}, {len(self.raw_columns)}) for its raw columns"
            )


def kept_train_rows(num_rows: int, cap: int | None, seed: int, silo: str) -> np.ndarray | None:
    """Sorted positions of the `num_rows` training rows that data.max_train_rows=`cap` keeps, a
    seeded random subset; None when there is no cap or the silo has no more rows than it."""
    from silo_pfl.seeding import numpy_rng

    if cap is None or num_rows <= cap:
        return None
    return np.sort(numpy_rng(seed, "max_train_rows", silo).choice(num_rows, cap, False))


def assemble(
    name: str,
    x: np.ndarray,
    y: np.ndarray,
    train: np.ndarray,
    test: np.ndarray,
    val_fraction: float,
    seed: int,
    strata: np.ndarray | None = None,
    source_file: str | Path | None = None,
    *,
    preprocessing: Preprocessing | Callable[[np.ndarray], Preprocessing] = Preprocessing(),
    max_train_rows: int | None = None,
    **extra: Any,
) -> SiloData:
    """A silo's SiloData from its raw rows `x` (before preprocessing) and train/test indices.

    Validation rows are carved from `train` here, the same way for every source: stratified on
    `strata` (default: the labels) and seeded by (seed, "val", silo). `max_train_rows` then keeps
    a seeded random subset of the rows left to train on (`kept_train_rows`). `preprocessing` is
    fixed, or fitted here on the silo's training rows it keeps plus its validation rows, in their
    order in `train`; never on a test row nor on a training row the cap drops. A silo left with
    no rows to train on is a DataError naming the silo (and `source_file`, its rows' file).
    """
    from silo_pfl.data.partitioners import holdout
    from silo_pfl.seeding import numpy_rng

    strata = y if strata is None else strata
    fit, val = holdout(strata[train], val_fraction, numpy_rng(seed, "val", name))
    if len(fit) == 0:
        where = f"silo {name}, file {source_file}" if source_file else f"silo {name}"
        raise DataError(
            f"{where}: no rows left to train on ({len(train) + len(test)} rows: {len(test)} held "
            f"out for test by data.test_fraction, {len(val)} for validation by "
            "data.val_fraction); give the silo more rows or lower those fractions"
        )
    kept = kept_train_rows(len(fit), max_train_rows, seed, name)
    fitted_on = train
    if kept is not None:
        fit = fit[kept]
        fitted_on = train[np.sort(np.concatenate([fit, val]))]
    if not isinstance(preprocessing, Preprocessing):
        preprocessing = preprocessing(x[fitted_on])
    return SiloData(
        name=name,
        x_train=preprocessing.apply(x[train][fit]),
        y_train=y[train][fit],
        x_val=preprocessing.apply(x[train][val]),
        y_val=y[train][val],
        x_test=preprocessing.apply(x[test]),
        y_test=y[test],
        num_train_total=len(train) if kept is None else len(fit) + len(val),
        preprocessing=preprocessing,
        **extra,
    )


def _digest(*arrays: np.ndarray) -> str:
    """A SHA-256 of `arrays`, each with its dtype and shape."""
    digest = hashlib.sha256()
    for array in arrays:
        digest.update(f"{array.dtype.str}{array.shape}".encode())
        digest.update(np.ascontiguousarray(array).data)
    return digest.hexdigest()
