"""The served form of a silo's personalized model: it answers on the silo's raw feature layout.

predict(rows): rows (a DataFrame with the silo's raw columns) -> the data source's `encode_raw`
-> the silo's `Preprocessing` (fitted on its own training rows) -> the network -> class index per
row. With params {"probabilities": true} it returns a DataFrame of the class and each class's
probability instead. Loading needs silo_pfl importable (e.g. `--env-manager local`), and the
modules of the run's `plugins`, which loading imports: a plugin may register the algorithm whose
`prepare_model` shapes the network.

A bad input (a missing column, a value that is not a finite number, a value the source does not
allow) raises `InputError`: one line naming the column and row, which `mlflow models serve` returns
as the `message` of an HTTP 400.
"""

from __future__ import annotations

import importlib
import numbers
from typing import Any

import mlflow.pyfunc
import numpy as np
import pandas as pd
import torch
from mlflow.exceptions import MlflowException
from mlflow.models import ModelSignature
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE
from mlflow.types.schema import AnyType, ColSpec, ParamSchema, ParamSpec, Schema, TensorSpec

from silo_pfl.algorithms import algorithm_config, build_algorithm
from silo_pfl.config import TrainConfig
from silo_pfl.data import Preprocessing, raw_encoder
from silo_pfl.errors import ConfigError, DataError, typed_line
from silo_pfl.models import build_model

STATE_ARTIFACT = "state_dict"
SHOWN = 3  # the missing columns, or the columns with a bad value, that an error names


class InputError(MlflowException):
    """Bad raw rows: MLflow's INVALID_PARAMETER_VALUE (HTTP 400) whose message stays one line.

    The scoring server rewrites a predict error's message to "Failed to predict data '<the
    whole input frame>'. Error: ...", many lines (thousands of pixels) echoing the request;
    this exception keeps its own line and ignores that rewrite.
    """

    def __init__(self, message: str) -> None:
        self._line = message
        super().__init__(message, error_code=INVALID_PARAMETER_VALUE)

    @property
    def message(self) -> str:
        """The one line, whatever the scoring server assigns."""
        return self._line

    @message.setter
    def message(self, _rewritten: str) -> None:
        """Ignored: see the class docstring."""


def _listed(names: list[str] | tuple[str, ...], shown: int = SHOWN) -> str:
    """The first `shown` names, then how many more."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def _first_bad(name: str, values: np.ndarray) -> str:
    """`name (row R: missing)` or `name (row R: inf)` for a column's first non-finite value."""
    row = int(np.argmax(~np.isfinite(values)))
    value = "missing" if np.isnan(values[row]) else f"{values[row]:g}"
    return f"{name} (row {row}: {value})"


def signature(raw_columns: tuple[str, ...]) -> ModelSignature:
    """The served interface: the raw columns in, a class index per row out.

    Each raw column may be of any numeric type: clients send 63 or 63.0, and MLflow would refuse
    int64 for a double column. Every column is needed, but the signature marks them optional so
    that `SiloPyfunc.inputs` checks them: MLflow's own error lists the whole schema and every
    missing column (thousands for a 3x32x32 image), SiloPyfunc's names how many and the first few.
    """
    return ModelSignature(
        inputs=Schema([ColSpec(AnyType(), name, required=False) for name in raw_columns]),
        outputs=Schema([TensorSpec(np.dtype(np.int64), (-1,))]),
        params=ParamSchema([ParamSpec("probabilities", "boolean", False)]),
    )


def import_plugins(modules: list[str]) -> None:
    """Import the run's plugin modules, which may register the model's algorithm; one that
    cannot be imported is a ConfigError naming it."""
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as exc:
            raise ConfigError(
                f"plugins: the model's run used plugin module {module!r}, which cannot be "
                f"imported here ({typed_line(exc)}); it must be importable where the model is "
                "loaded or served, e.g. installed in the serving environment or on PYTHONPATH"
            ) from None


class SiloPyfunc(mlflow.pyfunc.PythonModel):
    """A silo's network with its raw-row encoder and its Preprocessing."""

    # The logged signature (the raw columns) validates inputs, not type hints on predict.
    _skip_type_hint_validation = True

    def __init__(
        self,
        source: str,
        model_name: str,
        hidden: list[int],
        input_shape: tuple[int, ...],
        num_classes: int,
        raw_columns: tuple[str, ...],
        preprocessing: Preprocessing,
        adapter_dim: int = 0,
        algorithm: dict[str, Any] | None = None,
        plugins: list[str] | None = None,
    ) -> None:
        self.source = source
        self.model_name = model_name
        self.hidden = list(hidden)
        self.input_shape = tuple(input_shape)
        self.num_classes = num_classes
        self.raw_columns = tuple(raw_columns)
        self.preprocessing = preprocessing
        self.adapter_dim = adapter_dim
        self.algorithm = dict(algorithm or {"name": "fedavg"})  # its prepare_model shapes the net
        self.plugins = list(plugins or [])  # the run's plugin modules, imported before it

    def load_context(self, context: Any) -> None:
        """Build the network and load the silo's state_dict (global + its local keys)."""
        # A model logged before plugins were recorded has no `plugins` attribute.
        import_plugins(getattr(self, "plugins", []))
        state = torch.load(context.artifacts[STATE_ARTIFACT], weights_only=True)
        network = build_model(
            self.model_name, self.input_shape, self.num_classes, self.hidden, self.adapter_dim
        )
        algorithm = build_algorithm(algorithm_config(self.algorithm), TrainConfig())
        self.network = algorithm.prepare_model(network)
        self.network.load_state_dict(state)
        self.network.eval()
        self.encode = raw_encoder(self.source)

    def inputs(self, rows: Any) -> np.ndarray:
        """The network's inputs for raw rows, exactly as the silo's training inputs were made.

        Raises InputError, one line naming the column (and row, counted from 0), for a missing
        column, a value that is not a finite number, or one the data source does not allow.
        """
        frame = rows if isinstance(rows, pd.DataFrame) else pd.DataFrame(rows)
        self._check_columns(frame)
        raw = self._numbers(frame[list(self.raw_columns)])
        try:
            encoded = self.encode(raw)
        except DataError as exc:
            raise InputError(str(exc)) from None
        with np.errstate(over="ignore", invalid="ignore"):
            inputs = self.preprocessing.apply(encoded)
        self._check_finite(encoded, inputs)
        return inputs

    def _check_finite(self, encoded: np.ndarray, inputs: np.ndarray) -> None:
        """A finite raw value too large for the network's float32 inputs once normalised (1e300,
        say) would be answered as class 0 with NaN probabilities: an InputError instead."""
        if inputs.size == 0:  # no rows: nothing to answer, nothing to refuse
            return
        bad = ~np.isfinite(inputs.reshape(len(inputs), -1))
        if not bad.any():
            return
        row, feature = (int(i) for i in np.argwhere(bad)[0])
        names = self.preprocessing.feature_names
        column = names[feature] if feature < len(names) else f"feature {feature}"
        value = encoded.reshape(len(encoded), -1)[row, feature]
        raise InputError(
            f"column {column}, row {row}: got {value:g}, too large for the model (normalised, "
            "it is no finite float32); expected a value of the size the silo trained on"
        )

    def _check_columns(self, frame: pd.DataFrame) -> None:
        """Every raw column is there, else how many are expected and the first few missing."""
        missing = [c for c in self.raw_columns if c not in frame.columns]
        if not missing:
            return
        count = len(self.raw_columns)
        expected = (
            ", ".join(self.raw_columns)
            if count <= 12
            else f"{self.raw_columns[0]} .. {self.raw_columns[-1]}"
        )
        raise InputError(
            f"input lacks {len(missing)} of the model's {count} raw columns: "
            f"{_listed(missing)}; expected the columns {expected}"
        )

    def _numbers(self, columns: pd.DataFrame) -> np.ndarray:
        """The raw columns as float64; a value that is not a finite number is an InputError."""
        mixed: dict[str, pd.Series] = {}  # columns of objects (numbers and nulls), as numbers
        for name in columns.columns:
            column = columns[name]
            if pd.api.types.is_numeric_dtype(column):
                continue
            for row, value in enumerate(column.to_numpy(dtype=object)):
                if not (value is None or value is pd.NA or isinstance(value, numbers.Real)):
                    raise InputError(
                        f"column {name}, row {row}: got {value!r:.40}, expected a finite number"
                    )
            mixed[name] = pd.to_numeric(column)
        raw = columns.assign(**mixed).to_numpy(dtype=np.float64)
        bad = ~np.isfinite(raw)
        if bad.any():
            found = [
                _first_bad(str(name), raw[:, k])
                for k, name in enumerate(columns.columns)
                if bad[:, k].any()
            ]
            raise InputError(
                f"input has missing or non-finite values in column(s) {_listed(found)}; "
                "expected a finite number in every raw column"
            )
        return raw

    def predict(self, context: Any, model_input, params: dict[str, Any] | None = None) -> Any:
        """Class index per row; with params probabilities=true, a frame with probabilities.

        `model_input` (a DataFrame of raw rows) has no type hint: MLflow reads one as a schema.
        """
        with torch.no_grad():
            logits = self.network(torch.from_numpy(self.inputs(model_input)))
        classes = logits.argmax(dim=1).numpy()
        if not (params or {}).get("probabilities"):
            return classes
        probabilities = torch.softmax(logits, dim=1).numpy()
        columns = {f"p_{k}": probabilities[:, k] for k in range(probabilities.shape[1])}
        return pd.DataFrame({"class": classes, **columns})
