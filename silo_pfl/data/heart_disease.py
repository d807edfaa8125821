"""UCI Heart Disease: four hospitals as natural silos, split exactly as FLamby's Fed-Heart-Disease.

Preprocessing, as FLamby's `fed_heart_disease/dataset.py`:

- read `heart_disease/processed.<hospital>.data`, drop columns 10-12 (slope, ca, thal), then drop
  rows with a missing value; these are the hospital's "complete rows";
- label: 1 when num > 0 (disease), else 0;
- train/test rows: FLamby's sklearn split, shipped as `heart_disease/flamby_split.json` (written
  by `silo_pfl.data.heart_disease_split`), so silos never import sklearn;
- one-hot cp (levels 1-4) and restecg (levels 0-2) dropping the first level: 13 features;
- normalise with the mean and std (ddof=1, as torch) of the hospital's own FLamby training rows
  (validation rows included; with data.max_train_rows, only the training rows it keeps).
  A feature constant on those rows (e.g. chol, always 0 at switzerland) keeps std 1, where FLamby
  divides by std + 1e-9; both give 0 for that feature on training rows.

Raw layout: a raw row has the 10 columns RAW_COLUMNS (age .. oldpeak, categorical cp and restecg
as their codes). `encode_raw` turns raw rows into the 13 FEATURE_NAMES columns, and the silo's
`Preprocessing` (which describes those 13 encoded features) normalises them.

Validation rows are carved from the FLamby training rows (stratified, seeded by the federation
seed); the FLamby split itself does not depend on the seed.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from silo_pfl.config import DataConfig
from silo_pfl.data.base import SiloData, assemble, fit_preprocessing
from silo_pfl.errors import DataError, one_line

SILOS = ("cleveland", "hungarian", "switzerland", "va")
DATA_DIR = Path(__file__).with_name("heart_disease")
SPLIT_FILE = DATA_DIR / "flamby_split.json"
RAW_COLUMNS = (
    "age",
    "sex",
    "cp",
    "trestbps",
    "chol",
    "fbs",
    "restecg",
    "thalach",
    "exang",
    "oldpeak",
)
CATEGORIES = {"cp": (1, 2, 3, 4), "restecg": (0, 1, 2)}
BINARY = ("sex", "fbs", "exang")  # 0/1 codes, fed to the model as they are
NUMERIC_COLUMNS = tuple(name for name in RAW_COLUMNS if name not in CATEGORIES)
FEATURE_NAMES = NUMERIC_COLUMNS + tuple(
    f"{name}_{level}" for name, levels in CATEGORIES.items() for level in levels[1:]
)
NUM_CLASSES = 2


@dataclass
class Params(DataConfig):
    """data.* of data.source=heart_disease: only the validation share; the split is FLamby's."""


def validate(cfg: Params) -> None:
    """Nothing to check: the hospitals and their split are fixed."""


def input_shape(cfg: Params) -> tuple[int, ...]:
    """The shape of one silo's inputs, known at load: the encoded feature vector."""
    return (len(FEATURE_NAMES),)


def silo_names(cfg: Params) -> list[str]:
    """The four hospitals, in FLamby's center order."""
    return list(SILOS)


def data_file(silo: str) -> Path:
    """The shipped UCI file of a hospital."""
    return DATA_DIR / f"processed.{silo}.data"


def _check_silo(silo: str) -> None:
    if silo not in SILOS:
        raise DataError(
            f"silo {silo}: not a heart_disease hospital; expected one of {', '.join(SILOS)}"
        )


def read_complete_rows(silo: str) -> tuple[np.ndarray, np.ndarray]:
    """A hospital's complete raw rows (n, 10) in RAW_COLUMNS order and binary labels (n,)."""
    _check_silo(silo)
    path = data_file(silo)
    try:
        table = np.loadtxt(path, delimiter=",", dtype=np.float64, ndmin=2)
    except (OSError, ValueError) as exc:
        reason = one_line(exc)
        raise DataError(f"silo {silo}: cannot read {path}: {reason}") from None
    table = np.delete(table, [10, 11, 12], axis=1)
    table = table[~np.isnan(table).any(axis=1)]
    return table[:, :-1], (table[:, -1] > 0).astype(np.int64)


def example_row() -> np.ndarray:
    """A synthetic raw row for a served model's signature: 0 in every numeric column (no
    patient is 0 years old) and each categorical column's first code."""
    return np.array([[CATEGORIES[n][0] if n in CATEGORIES else 0.0 for n in RAW_COLUMNS]])


def encode_raw(rows: np.ndarray) -> np.ndarray:
    """Map raw rows (n, 10) in RAW_COLUMNS order to the 13 FEATURE_NAMES columns (float64)."""
    rows = np.asarray(rows, dtype=np.float64)
    if rows.ndim != 2 or rows.shape[1] != len(RAW_COLUMNS):
        raise DataError(
            f"heart_disease raw rows: got shape {rows.shape}, expected (n, {len(RAW_COLUMNS)}) "
            f"with columns {', '.join(RAW_COLUMNS)}"
        )
    codes = {**CATEGORIES, **{name: (0, 1) for name in BINARY}}
    for name, levels in codes.items():
        column = rows[:, RAW_COLUMNS.index(name)]
        unknown = ~np.isin(column, levels)
        if unknown.any():
            row = int(np.argmax(unknown))
            raise DataError(
                f"heart_disease raw rows: column {name} has {column[row]:g} (row {row}), expected "
                f"one of {', '.join(map(str, levels))}"
            )
    dummies = [rows[:, [RAW_COLUMNS.index(name) for name in NUMERIC_COLUMNS]]]
    for name, levels in CATEGORIES.items():
        column = rows[:, RAW_COLUMNS.index(name)]
        dummies.append(column[:, None] == np.asarray(levels[1:], dtype=np.float64)[None, :])
    return np.hstack(dummies).astype(np.float64)


def flamby_split(silo: str) -> tuple[np.ndarray, np.ndarray]:
    """The shipped FLamby (train, test) indices into the hospital's complete rows, ascending."""
    _check_silo(silo)
    try:
        split = json.loads(SPLIT_FILE.read_text())["hospitals"][silo]
        return np.asarray(split["train"], dtype=np.int64), np.asarray(split["test"], np.int64)
    except (OSError, ValueError, KeyError) as exc:
        raise DataError(
            f"silo {silo}: cannot read its FLamby split from {SPLIT_FILE} ({exc!r}); rebuild it "
            "with python -m silo_pfl.data.heart_disease_split"
        ) from None


def load(cfg: Params, silo: str, seed: int) -> SiloData:
    """The hospital's FLamby train/test rows, normalised, with validation rows from train."""
    raw, labels = read_complete_rows(silo)
    train, test = flamby_split(silo)
    if len(train) + len(test) != len(labels) or max(train.max(), test.max()) >= len(labels):
        raise DataError(
            f"silo {silo}: {SPLIT_FILE} does not match the {len(labels)} complete rows of "
            f"{data_file(silo)}; rebuild it with python -m silo_pfl.data.heart_disease_split"
        )
    return assemble(
        silo,
        encode_raw(raw),
        labels,
        train,
        test,
        cfg.val_fraction,
        seed,
        preprocessing=functools.partial(fit_preprocessing, FEATURE_NAMES, ddof=1),  # as FLamby
        max_train_rows=cfg.max_train_rows,
        num_classes=NUM_CLASSES,
        raw_columns=RAW_COLUMNS,
        x_test_raw=raw[test],
    )
