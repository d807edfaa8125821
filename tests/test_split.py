"""The split: which state_dict keys are local, for every rule, and the privacy guard."""

import numpy as np
import pytest

from silo_pfl.algorithms import algorithm_config, build_algorithm
from silo_pfl.config import TrainConfig
from silo_pfl.errors import ConfigError
from silo_pfl.models import blocks, build_model
from silo_pfl.split import PrivacyError, check_split, compute_split, parse_rules


def cnn(bn: bool = False):
    return build_model("cnn_small_bn" if bn else "cnn_small", (1, 8, 8), 10)


def test_blocks_are_layers_in_forward_order():
    assert blocks(cnn()) == ["body.conv1", "body.conv2", "body.fc", "head"]
    # BatchNorm belongs to the layer before it.
    assert blocks(cnn(bn=True)) == ["body.conv1", "body.conv2", "body.fc", "head"]


def test_head_rule_keeps_only_the_head_local():
    split = compute_split(cnn(), ["head"])
    assert split.local_keys == ("head.weight", "head.bias")
    assert split.local_parameters == 64 * 10 + 10
    assert split.global_parameters + split.local_parameters == sum(
        p.numel() for p in cnn().parameters()
    )
    assert split.global_bytes == 4 * split.global_parameters


def test_batchnorm_rule_includes_running_statistics():
    split = compute_split(cnn(bn=True), ["batchnorm"])
    local = set(split.local_keys)
    for bn in ("body.bn1", "body.bn2", "body.bn3"):
        for suffix in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked"):
            assert f"{bn}.{suffix}" in local
    assert not any(k.startswith(("body.conv", "body.fc", "head")) for k in local)


def test_adapters_rule_keeps_every_adapter_local_and_adapters_join_the_block_before():
    model = build_model("cnn_small_bn", (1, 8, 8), 10, adapter_dim=4)
    assert blocks(model) == ["body.conv1", "body.conv2", "body.fc", "head"]
    split = compute_split(model, ["adapters"])
    expected = {
        f"body.adapter{i}.{layer}.{p}"
        for i in (1, 2, 3)
        for layer in ("down", "up")
        for p in ("weight", "bias")
    }
    assert set(split.local_keys) == expected
    assert split.local_parameters == sum(
        p.numel() for n, p in model.named_parameters() if n.startswith("body.adapter")
    )
    with pytest.raises(ConfigError, match=r"rule 'adapters' matches no .*model.adapter_dim > 0"):
        compute_split(cnn(), ["adapters"])


def test_last_and_first_k_count_blocks():
    model = cnn(bn=True)
    last2 = set(compute_split(model, ["last:2"]).local_keys)
    assert {k.split(".")[1] for k in last2 if k.startswith("body")} == {"fc", "bn3"}
    assert "head.weight" in last2
    first1 = set(compute_split(model, ["first:1"]).local_keys)
    assert {k.rsplit(".", 1)[0] for k in first1} == {"body.conv1", "body.bn1"}


def test_pattern_and_all_rules():
    assert compute_split(cnn(), ["pattern:body.conv1.*"]).local_keys == (
        "body.conv1.weight",
        "body.conv1.bias",
    )
    split = compute_split(cnn(), ["all"])
    assert split.global_keys == () and split.global_bytes == 0


def test_resnet18_split_by_blocks():
    model = build_model("resnet18", (3, 32, 32), 10)
    assert blocks(model)[-3:] == ["body.layer3", "body.layer4", "head"]
    local = compute_split(model, ["last:2"]).local_keys
    assert all(k.startswith(("body.layer4.", "head.")) for k in local)


@pytest.mark.parametrize(
    ("rules", "message"),
    [
        (["tail"], "split.local[0]: got 'tail'"),
        (["head", "last:0"], "split.local[1]: got 'last:0', expected last:K with K >= 1"),
        (["first:x"], "split.local[0]"),
        (["pattern:"], "split.local[0]"),
    ],
)
def test_bad_rules_name_the_entry(rules, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_rules(rules)


def test_rule_that_matches_nothing_or_too_many_blocks_is_an_error():
    with pytest.raises(ConfigError, match="matches no state_dict key"):
        compute_split(cnn(), ["batchnorm"])
    with pytest.raises(ConfigError, match="more blocks than the model has"):
        compute_split(cnn(), ["last:9"])


def test_outgoing_refuses_local_keys_and_partial_payloads():
    split = compute_split(cnn(), ["head"])
    state = {k: v.numpy() for k, v in cnn().state_dict().items()}
    assert set(split.outgoing(split.global_part(state))) == set(split.global_keys)
    with pytest.raises(PrivacyError, match="head.weight"):
        split.outgoing({**split.global_part(state), "head.weight": np.zeros(1)})
    partial = dict(split.global_part(state))
    partial.pop("body.fc.bias")
    with pytest.raises(PrivacyError, match="body.fc.bias"):
        split.outgoing(partial)


def test_check_split_names_the_rules_the_algorithm_and_what_is_allowed():
    everything, nothing = compute_split(cnn(), ["all"]), compute_split(cnn(), [])
    assert everything.rules == ("all",) and nothing.rules == ()
    with pytest.raises(ConfigError) as info:
        check_split(everything, "fedper", needs_global=True, needs_local=False)
    assert str(info.value) == (
        "split.local: split.local=[all] leaves no global keys, so algorithm fedper has nothing to "
        "federate; keep some keys global (e.g. split.local=[head]), or use algorithm.name=local to "
        "train each silo alone"
    )
    with pytest.raises(ConfigError) as info:
        check_split(nothing, "fedrep", needs_global=True, needs_local=True)
    assert str(info.value) == (
        "split.local: split.local=[] leaves no local keys, but algorithm fedrep trains or keeps "
        "personal (local) keys; name some (e.g. split.local=[head]), or use an algorithm without "
        "them, e.g. algorithm.name=fedavg"
    )
    check_split(everything, "local", needs_global=False, needs_local=True)
    check_split(nothing, "fedavg", needs_global=True, needs_local=False)


@pytest.mark.parametrize(
    ("algorithm", "rules", "missing"),
    [
        ({"name": "fedavg"}, [], None),
        ({"name": "fedavg"}, ["all"], "global"),
        ({"name": "fedprox"}, [], None),
        ({"name": "ditto"}, [], None),
        ({"name": "fedper"}, ["head"], None),
        ({"name": "fedper"}, [], "local"),
        ({"name": "fedper"}, ["all"], "global"),
        ({"name": "fedrep"}, [], "local"),
        ({"name": "fedbn"}, ["batchnorm"], None),
        ({"name": "fedbn"}, [], "local"),
        ({"name": "finetune"}, [], None),
        ({"name": "finetune", "finetune": {"trainable": "local"}}, [], "local"),
        ({"name": "finetune", "finetune": {"trainable": "local"}}, ["head"], None),
        ({"name": "finetune", "finetune": {"trainable": "local", "epochs": 0}}, [], None),
        ({"name": "local"}, ["all"], None),
        ({"name": "local"}, [], "local"),
    ],
)
def test_each_algorithm_declares_the_keys_its_procedure_needs(algorithm, rules, missing):
    built = build_algorithm(algorithm_config(algorithm), TrainConfig())
    split = compute_split(cnn(bn=True), rules)
    if missing is None:
        built.check_split(split)
        return
    with pytest.raises(ConfigError, match=rf"leaves no {missing} keys, .*algorithm {built.name} "):
        built.check_split(split)


def test_a_leading_module_without_state_is_no_block():
    """mlp's body starts with a Flatten: first:1 is its first hidden layer, not the Flatten."""
    model = build_model("mlp", (13,), 2, (32, 16))
    assert blocks(model) == ["body.fc1", "body.fc2", "head"]
    assert compute_split(model, ["first:1"]).local_keys == ("body.fc1.weight", "body.fc1.bias")
