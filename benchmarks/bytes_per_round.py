"""Bytes each silo sends per round under each algorithm's split, against full-model FedAvg.

    python benchmarks/bytes_per_round.py [--out docs/results/issue10_bytes_per_round.json]

No training and no Ray: each model is built as a silo builds it (`models.build_model`, then the
algorithm's `prepare_model`), and split by the rules in force (`settings.split_rules`: the job's
`split.local`, else the algorithm's own) with `split.compute_split`, exactly as a silo does.
A silo sends the delta of every global state_dict key each round (float32 parameters and any
global buffers; the server's broadcast back is the same size), so `Split.global_bytes` is what
it sends; with `aggregation.secure` every value costs 8 bytes instead of 4.

Models: cnn_small on 8x8 digits (1x8x8, 10 classes), resnet18 on 3x32x32 (10 classes) and the
transformer (model.hidden=[32]: 2 blocks of width 32) on 8x8 digits. A row a model cannot take
(adapters on resnet18, the transformer's attention pattern on the others) is refused in one line,
printed.
"""

from __future__ import annotations

import argparse
import json

from paths import in_repo

from silo_pfl.algorithms import build_algorithm
from silo_pfl.errors import ConfigError
from silo_pfl.models import build_model
from silo_pfl.settings import load_config, split_rules
from silo_pfl.split import compute_split

JOB_NAME = "jobs/digits_label_skew.yaml"  # as the table names it
JOB = in_repo(JOB_NAME)
MODELS = {"cnn_small": (1, 8, 8), "resnet18": (3, 32, 32), "transformer": (1, 8, 8)}
NUM_CLASSES = 10
# label -> overrides; fedavg first: the baseline every other row is compared with.
SETUPS = {
    "fedavg": ["algorithm.name=fedavg"],
    "fedper (head)": ["algorithm.name=fedper"],
    "fedper (last:2)": ["algorithm.name=fedper", "split.local=[last:2]"],
    "fedper (block2 attention)": [
        "algorithm.name=fedper",
        "split.local=[pattern:body.block2.attn.*]",
    ],
    "fedrep (head)": ["algorithm.name=fedrep"],
    "lg_fedavg (first:1)": ["algorithm.name=lg_fedavg"],
    "fedper (adapters, dim 8)": [
        "algorithm.name=fedper",
        "model.adapter_dim=8",
        "split.local=[adapters]",
    ],
}


def measure(model_name: str, overrides: list[str]) -> dict:
    """The split a silo of this model computes under these overrides, in numbers."""
    cfg = load_config(JOB, ["tracking.enabled=false", f"model.name={model_name}", *overrides])
    algorithm = build_algorithm(cfg.algorithm, cfg.train)
    model = build_model(
        model_name, MODELS[model_name], NUM_CLASSES, cfg.model.hidden, cfg.model.adapter_dim
    )
    rules = split_rules(cfg)
    split = compute_split(algorithm.prepare_model(model), rules)
    algorithm.check_split(split)
    return {
        "rules": rules,
        "global_parameters": split.global_parameters,
        "local_parameters": split.local_parameters,
        "bytes_per_round": split.global_bytes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", help="write the table as JSON here")
    args = parser.parse_args()
    rows: dict[str, dict] = {}
    header = f"{'model':<12}{'algorithm':<26}{'local params':>13}{'bytes/round':>13}{'saved':>8}"
    print(header)
    for model_name in MODELS:
        rows[model_name] = {}
        full = None
        for label, overrides in SETUPS.items():
            try:
                row = measure(model_name, overrides)
            except ConfigError as exc:
                rows[model_name][label] = {"refused": str(exc)}
                print(f"{model_name:<12}{label:<26}  n/a: {exc}")
                continue
            full = full if full is not None else row["bytes_per_round"]
            row["saved_vs_fedavg"] = 1 - row["bytes_per_round"] / full
            rows[model_name][label] = row
            print(
                f"{model_name:<12}{label:<26}{row['local_parameters']:>13,}"
                f"{row['bytes_per_round']:>13,}{100 * row['saved_vs_fedavg']:>7.2f}%"
            )
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"job": JOB_NAME, "input_shapes": MODELS, "results": rows}, fh, indent=2)


if __name__ == "__main__":
    main()
