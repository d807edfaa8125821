"""algorithm.finetune.trainable on the plain Silo and Server classes (real hospital data; digits
for a BatchNorm model): the fine-tuned copy a silo is judged and served by differs from the
round's model in exactly the parameters `trainable` names; the others stay bit-identical. (A bad
value's one-line ConfigError is in tests/test_config.py.) The frozen keys' BatchNorm running
statistics stay as they were."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from plain_federation import federation, play_round

from silo_pfl.errors import ConfigError

LOCAL = {"head.weight", "head.bias"}  # split.local=[head] on the mlp
GLOBAL = {"body.fc1.weight", "body.fc1.bias"}
TRAINED = {"all": LOCAL | GLOBAL, "local": LOCAL, "global": GLOBAL}


@pytest.mark.parametrize("trainable", sorted(TRAINED))
def test_finetuning_trains_exactly_the_parameters_trainable_names(job, trainable):
    silos, server = federation(
        job,
        "finetune",
        "algorithm.finetune.epochs=2",
        f"algorithm.finetune.trainable={trainable}",
        "split.local=[head]",
        silos=("cleveland",),
    )
    silo = silos[0]
    assert set(silo.split.local_keys) == LOCAL and set(silo.split.global_keys) == GLOBAL
    _, state, _ = play_round(silos, server, 1, commit=True)
    # What the copy was fine-tuned from: the round's global keys and the silo's own local keys,
    # still in the silo's model.
    start = silo.model.state_dict()
    assert all(np.array_equal(start[k].numpy(), state[k]) for k in GLOBAL)
    judged = torch.load(silo.selected_path, weights_only=True)  # the model evaluate() judged
    assert set(judged) == set(start)
    changed = {k for k in start if not torch.equal(judged[k], start[k])}
    assert changed == TRAINED[trainable]


def test_finetuning_only_the_local_keys_needs_some(job):
    with pytest.raises(ConfigError) as info:
        job(
            "jobs/heart_disease.yaml",
            "algorithm.name=finetune",
            "algorithm.finetune.trainable=local",
        )
    message = str(info.value)
    assert message.startswith("split.local: split.local=[] leaves no local keys, but algorithm ")
    assert "finetune" in message and "\n" not in message


def finetuned_batchnorm_cnn(job):
    """trainable=local on FedBN's CNN (BatchNorm in its body) with split.local=[head]: the
    silo, the model the copy was fine-tuned from, and the copy it was judged by."""
    silos, server = federation(
        job,
        "finetune",
        "algorithm.finetune.trainable=local",
        "split.local=[head]",
        "model.name=cnn_small_bn",
        "data.num_silos=4",
        path="jobs/digits_feature_shift.yaml",
        silos=("silo_0",),
    )
    play_round(silos, server, 1, commit=True)
    silo = silos[0]
    return silo, silo.model.state_dict(), torch.load(silo.selected_path, weights_only=True)


def test_finetuning_the_local_keys_leaves_a_batchnorm_bodys_parameters_bit_identical(job):
    silo, start, judged = finetuned_batchnorm_cnn(job)
    trained = {k for k in start if not torch.equal(judged[k], start[k])}
    names = {name for name, _ in silo.model.named_parameters()}
    assert any(".bn" in k for k in names - {"head.weight", "head.bias"})
    assert trained & names == {"head.weight", "head.bias"}


def test_finetuning_the_local_keys_leaves_every_global_key_bit_identical(job):
    silo, start, judged = finetuned_batchnorm_cnn(job)
    moved = [k for k in silo.split.global_keys if not torch.equal(judged[k], start[k])]
    assert moved == []
