"""The names of the built-in algorithms and models, known without importing torch, so that the
config's first check (`config.check_ranges`) refuses a misspelt one at once, before Ray starts.
The registries are the truth: `tests/test_structure.py` holds these equal to
`silo_pfl.algorithms.ALGORITHMS` (without plugins) and `silo_pfl.models.MODELS`."""

from __future__ import annotations

ALGORITHMS = (
    "apfl",
    "ditto",
    "fedadagrad",
    "fedadam",
    "fedavg",
    "fedavgm",
    "fedbn",
    "fedper",
    "fedprox",
    "fedrep",
    "fedyogi",
    "finetune",
    "lg_fedavg",
    "local",
    "moe_heads",
    "perfedavg",
    "scaffold",
)
# what else an algorithm name may be: one a plugin registers (config key `plugins`)
OWN_ALGORITHM = "or one of your own, its module listed in plugins (e.g. plugins=[my_team.algos])"
MODELS = ("cnn_small", "cnn_small_bn", "mlp", "resnet18", "transformer")
