"""The server's starting point, built where torch is (the driver; tests in one process).

The server process imports no torch: the model it would build only to read its initial global
keys is built here instead, from the same seed as every silo's (`silo.init_model`), and handed
over with the split's global keys, the algorithm's strategy over them, and the silos' names.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from silo_pfl.algorithms import build_algorithm
from silo_pfl.config import FederationConfig
from silo_pfl.data import load_silo_data, silo_names
from silo_pfl.server import Server, ServerStart
from silo_pfl.settings import from_dict, split_rules
from silo_pfl.silo import init_model
from silo_pfl.split import compute_split


def server_start(
    cfg: FederationConfig, input_shape: Sequence[int], num_classes: int, total_rows: int
) -> ServerStart:
    """The initial global keys of `cfg`'s model for these inputs, and what goes with them;
    `total_rows`: the silos' training rows, summed (their SiloInfo.num_train)."""
    model = init_model(cfg, tuple(input_shape), num_classes)
    split = compute_split(model, split_rules(cfg))
    state = model.state_dict()
    initial = {k: state[k].numpy().copy() for k in split.global_keys}
    parameters = frozenset(name for name, _ in model.named_parameters()) & set(initial)
    strategy = build_algorithm(cfg.algorithm, cfg.train).server_strategy(initial)
    return ServerStart(initial, parameters, strategy, tuple(silo_names(cfg.data)), total_rows)


def new_server(
    config: dict[str, Any],
    input_shape: Sequence[int],
    num_classes: int,
    run_id: str = "default",
    total_rows: int | None = None,
) -> Server:
    """A Server in this process, for `config` (as `config.to_dict` made it); its silos' rows
    summed are read from their data here unless given."""
    cfg = from_dict(config)
    if total_rows is None:
        total_rows = sum(
            len(load_silo_data(cfg.data, name, cfg.seed).y_train) for name in silo_names(cfg.data)
        )
    return Server(config, server_start(cfg, input_shape, num_classes, total_rows), run_id)
