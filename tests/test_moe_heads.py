"""moe_heads on the plain Silo and Server classes: shared expert heads, a personal gate that
never leaves the silo, FedAvg when there is one expert, and a checkpoint that restores the gate."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from plain_federation import federation, play_round
from torch import nn

from silo_pfl.algorithms import build_algorithm
from silo_pfl.config import ModelConfig, to_dict
from silo_pfl.errors import ConfigError
from silo_pfl.models import LINEAR_HEAD_MODELS, MODELS, MoEHead, build_model
from silo_pfl.silo import Silo, init_model
from silo_pfl.split import compute_split

GATE_KEYS = ("head.gate.weight", "head.gate.bias")


def test_the_gate_is_local_and_never_leaves_the_silo(job):
    silos, server = federation(job, "moe_heads")
    assert set(GATE_KEYS) == set(silos[0].split.local_keys)
    assert all(key.startswith("head.experts.") for key in server.global_state() if "head" in key)
    initial = {k: v.clone() for k, v in silos[0].model.state_dict().items() if k in GATE_KEYS}
    for round_ in (1, 2):
        updates, _, _ = play_round(silos, server, round_)
        for update in updates:
            assert not set(update.delta) & set(GATE_KEYS)
        sent = [v for u in updates for v in u.delta.values()]
        for silo in silos:
            for key in GATE_KEYS:
                gate = silo.model.state_dict()[key].numpy()
                assert not np.array_equal(gate, initial[key].numpy())  # it trained
                assert not any(s.shape == gate.shape and np.array_equal(s, gate) for s in sent)
    assert not set(server.global_state()) & set(GATE_KEYS)


def test_one_expert_is_the_plain_model_and_fedavg(job):
    moe, moe_server = federation(job, "moe_heads", "algorithm.moe_heads.experts=1")
    fedavg, fedavg_server = federation(job, "fedavg")

    def shared(key: str) -> str:
        """The FedAvg key of a non-gate key of the one-expert model."""
        return key.replace("head.experts.0.", "head.")

    # The same initial weights (expert 0 is the model's own head), the same function.
    plain = fedavg[0].model.state_dict()
    for key, value in moe[0].model.state_dict().items():
        if key not in GATE_KEYS:
            assert torch.equal(value, plain[shared(key)])
    x = moe[0].val_xy[0]
    assert torch.equal(moe[0].model(x), fedavg[0].model(x))
    for round_ in (1, 2):
        m_updates, m_state, m_evals = play_round(moe, moe_server, round_)
        f_updates, f_state, f_evals = play_round(fedavg, fedavg_server, round_)
        for m, f in zip(m_updates, f_updates, strict=True):
            assert {shared(k) for k in m.delta} == set(f.delta)
            assert all(np.array_equal(v, f.delta[shared(k)]) for k, v in m.delta.items())
        assert all(np.array_equal(v, f_state[shared(k)]) for k, v in m_state.items())
        assert [e.val_loss for e in m_evals] == [e.val_loss for e in f_evals]


def test_the_output_is_a_convex_combination_of_the_experts_logits(job):
    silos, _ = federation(job, "moe_heads", "algorithm.moe_heads.experts=3")
    model = silos[0].model
    features = model.body(silos[0].val_xy[0]).detach()
    gates = model.head.gates(features)
    assert gates.shape == (len(features), 3)
    assert bool((gates >= 0).all()) and torch.allclose(gates.sum(dim=1), torch.ones(len(gates)))
    logits = torch.stack([expert(features) for expert in model.head.experts], dim=1)
    output = model.head(features)
    assert torch.allclose(output, (gates.unsqueeze(2) * logits).sum(dim=1))
    eps = 1e-5
    assert bool((output >= logits.min(dim=1).values - eps).all())
    assert bool((output <= logits.max(dim=1).values + eps).all())
    assert not torch.allclose(output, logits.mean(dim=1))  # weighted by the gate, not averaged


@pytest.mark.parametrize("option", ["experts=0", "class_bias=-1", "gate_warmup_epochs=-1"])
def test_a_bad_option_is_a_one_line_config_error_naming_it(job, option):
    with pytest.raises(ConfigError) as err:
        job("jobs/heart_disease.yaml", "algorithm.name=moe_heads", f"algorithm.moe_heads.{option}")
    message = str(err.value)
    assert f"algorithm.moe_heads.{option.split('=')[0]}" in message and "\n" not in message


def test_every_zoo_model_takes_an_moe_head_with_or_without_adapters(job):
    cfg = job(
        "jobs/heart_disease.yaml",
        "algorithm.name=moe_heads",
        "algorithm.moe_heads.experts=10",
        "algorithm.moe_heads.class_bias=10",
    )
    algorithm = build_algorithm(cfg.algorithm, cfg.train)
    shapes = {"mlp": (13,), "cnn_small": (1, 8, 8), "cnn_small_bn": (1, 8, 8)}
    shapes |= {"resnet18": (3, 32, 32), "transformer": (1, 8, 8)}
    assert set(shapes) == set(MODELS)
    for name, shape in shapes.items():
        for adapter_dim in (0, 4) if name != "resnet18" else (0,):
            model = build_model(name, shape, 10, (32,), adapter_dim)
            assert isinstance(model.head, nn.Linear) == (name in LINEAR_HEAD_MODELS)
            cfg.model = ModelConfig(name=name, adapter_dim=adapter_dim)
            algorithm.check_config(cfg)
            model = algorithm.prepare_model(model)
            assert isinstance(model.head, MoEHead) and len(model.head.experts) == 10
            # Expert e starts favouring class e.
            assert [int(e.bias.argmax()) for e in model.head.experts] == list(range(10))
            assert model.eval()(torch.zeros(2, *shape)).shape == (2, 10)
            split = compute_split(model, algorithm.local_rules())
            assert set(split.local_keys) == set(GATE_KEYS)
            if adapter_dim:
                both = compute_split(model, ["adapters", *algorithm.local_rules()])
                assert {k for k in both.local_keys if k.startswith("head.")} == set(GATE_KEYS)
    with pytest.raises(ConfigError, match="model.name") as err:
        MoEHead.from_head(nn.Sequential(nn.Linear(4, 2)), experts=2)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="model.name"):
        cfg.model = ModelConfig(name="a_model_without_a_linear_head")
        algorithm.check_config(cfg)


def test_split_rules_that_share_the_gate_are_refused_and_head_makes_all_experts_local(job):
    with pytest.raises(ConfigError, match="head.gate.weight is global"):
        federation(job, "moe_heads", "split.local=[adapters]", "model.adapter_dim=4")
    silos, server = federation(job, "moe_heads", "split.local=[head]")
    assert not any(key.startswith("head.") for key in server.global_state())
    assert set(GATE_KEYS) < set(silos[0].split.local_keys)


def test_a_restored_checkpoint_gives_the_gate_back_bit_for_bit(job):
    silos, server = federation(job, "moe_heads")
    _, state, evals = play_round(silos, server, 1)
    for silo in silos:
        silo.commit(1, keep=True)
    play_round(silos, server, 2)  # trains the gates further
    for silo, before in zip(silos, evals, strict=True):
        assert silo.evaluate(state, 1) != before
        silo.restore(1)
        assert silo.evaluate(state, 1) == before
    # A fresh process of the same silo (a restart) restores it from its directory alone.
    config, silo = to_dict(silos[0].cfg), silos[0]
    gate = {k: v.clone() for k, v in silo.model.state_dict().items() if k in GATE_KEYS}
    again = Silo(config, silo.name)
    again.rejoin(silo.data.input_shape, silo.num_classes, {}, 1)
    assert all(torch.equal(again.model.state_dict()[k], gate[k]) for k in GATE_KEYS)
    assert again.evaluate(state, 1) == evals[0]
    fresh = init_model(silo.cfg, silo.data.input_shape, silo.num_classes).state_dict()
    assert not all(torch.equal(fresh[k], gate[k]) for k in GATE_KEYS)
