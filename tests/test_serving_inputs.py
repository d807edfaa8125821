"""Bad raw rows for a silo's registered model get one line naming the column (and the row,
counted from 0) and what is allowed: through `mlflow.pyfunc.load_model(...).predict`, and as the
`message` of a real `mlflow models serve`'s HTTP 400. A heart-disease hospital and a digits silo
trained at data.image_shape=[3, 32, 32] are registered once for the module, and the hospital's
model is served once."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import mlflow.pyfunc
import numpy as np
import pandas as pd
import pytest
from mlflow.exceptions import MlflowException
from serving import post, registered_silo, served

from silo_pfl.data.heart_disease import RAW_COLUMNS

HEART = "models:/heart_disease-hungarian@champion"
DIGITS = "models:/digits_large-silo_1@champion"
ROW = [63, 1, 1, 145, 233, 1, 2, 150, 0, 2.3]  # the README's request


@dataclass
class Registered:
    """The module's store, its two loaded models and the digits silo's own raw test rows."""

    store: str
    heart: Any
    digits: Any
    digits_rows: np.ndarray


@pytest.fixture(scope="module")
def registered(tmp_path_factory) -> Iterator[Registered]:
    """Both silos' models registered in one SQLite store and loaded with pyfunc.load_model."""
    tmp = tmp_path_factory.mktemp("serving_inputs")
    store = f"sqlite:///{tmp / 'mlflow.db'}"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_TRACKING_URI", store)
        registered_silo(tmp, store, "hungarian")
        digits = registered_silo(
            tmp,
            store,
            "silo_1",
            "jobs/digits_dirichlet.yaml",
            "name=digits_large",
            "data.num_silos=4",
            "data.image_shape=[3,32,32]",
            "model.name=mlp",
            "model.hidden=[8]",
        )
        assert len(digits.data.raw_columns) == 3072
        yield Registered(
            store,
            mlflow.pyfunc.load_model(HEART),
            mlflow.pyfunc.load_model(DIGITS),
            digits.data.x_test_raw,
        )


@pytest.fixture(scope="module")
def heart_url(registered, tmp_path_factory) -> Iterator[str]:
    """The hospital's model behind `mlflow models serve`, started once for the module."""
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with served(HEART, registered.store, log) as url:
        yield url


def refusal(model: Any, frame: pd.DataFrame) -> str:
    """The message of the MlflowException that `model.predict(frame)` raises: one line."""
    with pytest.raises(MlflowException) as info:
        model.predict(frame)
    message = info.value.message
    assert "\n" not in message and str(info.value) == message, message
    return message


@pytest.mark.parametrize(
    ("column", "value", "shown"),
    [
        ("age", None, "missing"),
        ("chol", float("nan"), "missing"),
        ("oldpeak", float("inf"), "inf"),
        ("thalach", float("-inf"), "-inf"),
    ],
)
def test_a_missing_or_non_finite_value_is_refused_naming_its_column_and_row(
    registered, column, value, shown
):
    bad = list(ROW)
    bad[RAW_COLUMNS.index(column)] = value
    message = refusal(registered.heart, pd.DataFrame([ROW, bad], columns=list(RAW_COLUMNS)))
    assert message == (
        f"input has missing or non-finite values in column(s) {column} (row 1: {shown}); "
        "expected a finite number in every raw column"
    )


def test_every_column_with_a_bad_value_is_named_with_its_first_row(registered):
    rows = [list(ROW), list(ROW), list(ROW)]
    rows[2][0], rows[1][3], rows[2][3], rows[0][9] = None, float("inf"), None, float("nan")
    message = refusal(registered.heart, pd.DataFrame(rows, columns=list(RAW_COLUMNS)))
    assert message.startswith(
        "input has missing or non-finite values in column(s) age (row 2: missing), "
        "trestbps (row 1: inf), oldpeak (row 0: missing);"
    )


@pytest.mark.parametrize("value", [16.0, -0.25, 1.5])
def test_a_digits_pixel_outside_0_1_is_refused_naming_its_column(registered, value):
    """The README documents pixels in [0, 1]; sklearn's raw 0..16 gave wrong classes."""
    columns = [f"pixel_{i}" for i in range(3072)]
    good = pd.DataFrame(registered.digits_rows, columns=columns)
    assert len(registered.digits.predict(good)) == len(good)  # the silo's own rows are in range
    rows = registered.digits_rows[:3].copy()
    rows[2, 100] = value
    message = refusal(registered.digits, pd.DataFrame(rows, columns=columns))
    assert message == (
        f"digits raw rows: column pixel_100 has {value:g} (row 2), expected a pixel value in "
        "[0, 1] (the digits' 0..16 divided by 16)"
    )


def test_too_few_columns_say_how_many_are_expected_and_the_first_missing(registered):
    """A [3, 32, 32] model wants 3072 columns: a 64-column request is told so in one short line,
    not the list of ~3000 missing names."""
    rows = pd.DataFrame(np.zeros((1, 64)), columns=[f"pixel_{i}" for i in range(64)])
    assert refusal(registered.digits, rows) == (
        "input lacks 3008 of the model's 3072 raw columns: pixel_64, pixel_65, pixel_66 and "
        "3005 more; expected the columns pixel_0 .. pixel_3071"
    )


@pytest.mark.parametrize(
    ("columns", "row", "message"),
    [
        (
            RAW_COLUMNS,
            [None, *ROW[1:]],
            "input has missing or non-finite values in column(s) age (row 0: missing); "
            "expected a finite number in every raw column",
        ),
        (RAW_COLUMNS, ["abc", *ROW[1:]], "column age, row 0: got 'abc', expected a finite number"),
        (
            RAW_COLUMNS,
            [*ROW[:2], 9, *ROW[3:]],
            "heart_disease raw rows: column cp has 9 (row 0), expected one of 1, 2, 3, 4",
        ),
        (
            RAW_COLUMNS,
            [ROW[0], 7, *ROW[2:]],
            "heart_disease raw rows: column sex has 7 (row 0), expected one of 0, 1",
        ),
        (
            RAW_COLUMNS[:3],
            ROW[:3],
            "input lacks 7 of the model's 10 raw columns: trestbps, chol, fbs and 4 more; "
            "expected the columns age, sex, cp, trestbps, chol, fbs, restecg, thalach, exang, "
            "oldpeak",
        ),
    ],
    ids=["null", "string", "unknown-code", "binary-code", "missing-columns"],
)
def test_the_served_models_400_says_what_is_wrong_in_its_message(heart_url, columns, row, message):
    """Not MLflow's "Encountered an unexpected error ..." with the reason in stack_trace."""
    status, answer = post(heart_url, columns, [row], {"probabilities": True})
    assert (status, answer["error_code"], answer["message"]) == (
        400,
        "INVALID_PARAMETER_VALUE",
        message,
    ), answer
    status, answer = post(heart_url, RAW_COLUMNS, [ROW])
    assert status == 200 and len(answer["predictions"]) == 1, answer


def test_a_column_of_objects_is_read_as_numbers_and_its_nulls_as_missing(registered):
    """As a client's frame may hold them: Python ints, numpy floats and pandas' NA in one column."""
    frame = pd.DataFrame([ROW, ROW, ROW], columns=list(RAW_COLUMNS))
    frame["age"] = pd.Series([63, np.float32(41.0), True], dtype=object)
    assert len(registered.heart.predict(frame)) == 3
    frame["chol"] = pd.Series([233, pd.NA, None], dtype=object)
    assert refusal(registered.heart, frame) == (
        "input has missing or non-finite values in column(s) chol (row 1: missing); "
        "expected a finite number in every raw column"
    )


def test_a_finite_value_too_large_for_the_models_inputs_is_refused(registered):
    """1e300 is finite, so it passed the checks; normalised and cast to float32 it became inf,
    and the model answered class 0 with NaN probabilities."""
    bad = list(ROW)
    bad[RAW_COLUMNS.index("chol")] = -1e300
    message = refusal(registered.heart, pd.DataFrame([ROW, bad], columns=list(RAW_COLUMNS)))
    assert message == (
        "column chol, row 1: got -1e+300, too large for the model (normalised, it is no finite "
        "float32); expected a value of the size the silo trained on"
    )


def test_no_rows_get_no_answers(registered):
    """The finite check reshaped the inputs by their row count: 0 rows raised numpy's error."""
    assert len(registered.heart.predict(pd.DataFrame([], columns=list(RAW_COLUMNS)))) == 0
