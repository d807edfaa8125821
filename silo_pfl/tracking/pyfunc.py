"""The served form of a silo's personalized model: it answers on the silo's raw feature layout.

predict(rows): rows (a DataFrame with the silo's raw columns) -> the data source's `encode_raw`
-> the silo's `Preprocessing` (fitted on its own training rows) -> the network -> class index per
row. With params {"probabilities": true} it returns a DataFrame of the class and each class's
probability instead. Loading needs silo_pfl importable (e.g. `--env-manager local`).
"""

from __future__ import annotations

from typing import Any

import mlflow.pyfunc
import numpy as np
import pandas as pd
import torch
from mlflow.models import ModelSignature
from mlflow.types.schema import AnyType, ColSpec, ParamSchema, ParamSpec, Schema, TensorSpec

from silo_pfl.algorithms import algorithm_config, build_algorithm
from silo_pfl.config import TrainConfig
from silo_pfl.data import Preprocessing, raw_encoder
from silo_pfl.models import build_model

STATE_ARTIFACT = "state_dict"


def signature(raw_columns: tuple[str, ...]) -> ModelSignature:
    """The served interface: the raw columns in, a class index per row out.

    Each raw column is required and may be of any numeric type: clients send 63 or 63.0, and
    MLflow would refuse int64 for a double column.
    """
    return ModelSignature(
        inputs=Schema([ColSpec(AnyType(), name) for name in raw_columns]),
        outputs=Schema([TensorSpec(np.dtype(np.int64), (-1,))]),
        params=ParamSchema([ParamSpec("probabilities", "boolean", False)]),
    )


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

    def load_context(self, context: Any) -> None:
        """Build the network and load the silo's state_dict (global + its local keys)."""
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
        """The network's inputs for raw rows, exactly as the silo's training inputs were made."""
        frame = rows if isinstance(rows, pd.DataFrame) else pd.DataFrame(rows)
        missing = [c for c in self.raw_columns if c not in frame.columns]
        if missing:
            raise ValueError(
                f"input lacks raw column(s) {', '.join(missing[:5])}; expected columns "
                f"{', '.join(self.raw_columns[:12])}{' ...' if len(self.raw_columns) > 12 else ''}"
            )
        raw = frame[list(self.raw_columns)].to_numpy(dtype=np.float64)
        return self.preprocessing.apply(self.encode(raw))

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
