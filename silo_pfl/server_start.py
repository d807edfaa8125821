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
from silo_pfl.data import silo_names
from silo_pfl.server import Server, ServerStart
from silo_pfl.settings import from_dict, split_rules
from silo_pfl.silo import init_model
from silo_pfl.split import compute_split


def server_start(
    cfg: FederationConfig, input_shape: Sequence[int], num_classes: int
) -> ServerStart:
    """The initial global keys of `cfg`'s model for these inputs, and what goes with them."""
    model = init_model(cfg, tuple(input_shape), num_classes)
    split = compute_split(model, split_rules(cfg))
    state = model.state_dict()
    initial = {k: state[k].numpy().copy() for k in split.global_keys}
    parameters = frozenset(name for name, _ in model.named_parameters()) & set(initial)
    strategy = build_algorithm(cfg.algorithm, cfg.train).server_strategy(initial)
    return ServerStart(initial, parameters, strategy, tuple(silo_names(cfg.data)))


def new_server(
    config: dict[str, Any],
    input_shape: Sequence[int],
    num_classes: int,
    run_id: str = "default",
) -> Server:
    """A Server in this process, for `config` (as `config.to_dict` made it)."""
    return Server(config, server_start(from_dict(config), input_shape, num_classes), run_id)
