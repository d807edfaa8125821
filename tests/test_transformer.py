"""model.name=transformer: its blocks and key names, what split rules select, image and tabular
inputs, determinism, a short federation with personal attention, and its config errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from plain_federation import federation, play_round
from torch import nn

from silo_pfl.algorithms import ALGORITHMS
from silo_pfl.errors import ConfigError
from silo_pfl.models import blocks, build_model
from silo_pfl.split import compute_split
from silo_pfl.transformer import EncoderBlock, patch_size

BLOCK = [
    "norm1.weight",
    "norm1.bias",
    "attn.in_proj_weight",
    "attn.in_proj_bias",
    "attn.out_proj.weight",
    "attn.out_proj.bias",
    "norm2.weight",
    "norm2.bias",
    "mlp.fc1.weight",
    "mlp.fc1.bias",
    "mlp.fc2.weight",
    "mlp.fc2.bias",
]


def digits_model(hidden=(32,), adapter_dim=0):
    return build_model("transformer", (1, 8, 8), 10, hidden, adapter_dim)


def test_blocks_are_the_embedding_each_encoder_block_and_the_head():
    model = digits_model()
    assert blocks(model) == ["body.embed", "body.block1", "body.block2", "head"]
    assert list(model.state_dict()) == [
        "body.embed.pos",
        "body.embed.proj.weight",
        "body.embed.proj.bias",
        *(f"body.block{i}.{key}" for i in (1, 2) for key in BLOCK),
        "body.norm.weight",
        "body.norm.bias",
        "head.weight",
        "head.bias",
    ]
    block = model.body.block2
    assert isinstance(block, EncoderBlock) and isinstance(block.attn, nn.MultiheadAttention)
    assert block.attn.batch_first and block.attn.num_heads == 2 and block.attn.embed_dim == 32
    assert isinstance(model.head, nn.Linear) and model.head.in_features == 32
    # [dim, depth, heads]; adapters join the encoder block before them.
    deep = digits_model((48, 4, 3), adapter_dim=4)
    assert blocks(deep) == ["body.embed", *(f"body.block{i}" for i in range(1, 5)), "head"]
    assert deep.body.block4.attn.num_heads == 3
    assert [n for n, _ in deep.body.named_children() if n.startswith("adapter")] == [
        f"adapter{i}" for i in range(1, 5)
    ]
    # A new adapter is the identity: with the plain model's weights, the same outputs.
    adapted, plain = digits_model(adapter_dim=4), digits_model()
    missing, unexpected = adapted.load_state_dict(plain.state_dict(), strict=False)
    assert not unexpected and all(".adapter" in k for k in missing)
    x = torch.randn(3, 1, 8, 8)
    torch.testing.assert_close(adapted.eval()(x), plain.eval()(x))


def test_last_k_first_k_and_pattern_rules_select_exactly_the_expected_keys():
    model = digits_model()

    def local(*rules: str) -> set[str]:
        return set(compute_split(model, list(rules)).local_keys)

    head = {"head.weight", "head.bias"}
    last_block = {f"body.block2.{key}" for key in BLOCK} | {"body.norm.weight", "body.norm.bias"}
    assert local("last:1") == head == local("head")
    assert local("last:2") == last_block | head
    assert local("last:3") == last_block | head | {f"body.block1.{key}" for key in BLOCK}
    assert local("first:1") == {"body.embed.pos", "body.embed.proj.weight", "body.embed.proj.bias"}
    attention = {f"body.block2.attn.{k}" for k in ("in_proj_weight", "in_proj_bias")}
    attention |= {"body.block2.attn.out_proj.weight", "body.block2.attn.out_proj.bias"}
    assert local("pattern:body.block2.attn.*") == attention
    assert local("pattern:body.block2.attn.*", "head") == attention | head
    adapted = digits_model(adapter_dim=4)
    assert {k.split(".")[1] for k in compute_split(adapted, ["adapters"]).local_keys} == {
        "adapter1",
        "adapter2",
    }
    with pytest.raises(ConfigError, match="more blocks than the model has"):
        compute_split(model, ["last:5"])


def test_images_become_patches_and_feature_vectors_one_token_per_feature():
    assert patch_size(8, 8) == 4 and patch_size(32, 32) == 4 and patch_size(6, 9) == 3
    image = digits_model()
    assert image.body.embed.pos.shape == (4, 32)  # 2x2 patches of 4x4 pixels
    assert image(torch.randn(5, 1, 8, 8)).shape == (5, 10)
    rgb = build_model("transformer", (3, 32, 32), 10, (64,))
    assert rgb(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    tabular = build_model("transformer", (13,), 2)
    assert tabular.body.embed.pos.shape == (13, 32)
    assert tabular(torch.randn(4, 13)).shape == (4, 2)
    # The same key names for both kinds of input: a split probed on one holds for the other.
    assert list(tabular.state_dict()) == list(image.state_dict())
    # Feature f's token is x_f * w_f + b_f plus its embedding: it depends on x_f alone.
    x = torch.randn(3, 13)
    tokens = tabular.body.embed(x)
    moved = x.clone()
    moved[:, 4] += 1.0
    changed = (tabular.body.embed(moved) - tokens).abs().sum(dim=(0, 2))
    assert changed[4] > 0 and torch.count_nonzero(changed) == 1


def test_the_transformer_is_deterministic_under_a_seed():
    def build(seed: int):
        torch.manual_seed(seed)
        return digits_model()

    a, b, c = build(0), build(0), build(1)
    assert all(torch.equal(v, b.state_dict()[k]) for k, v in a.state_dict().items())
    assert not torch.equal(a.body.block1.attn.in_proj_weight, c.body.block1.attn.in_proj_weight)
    x = torch.randn(4, 1, 8, 8)
    torch.testing.assert_close(a.eval()(x), b.eval()(x), rtol=0, atol=0)


def test_a_federation_with_personal_attention_shares_everything_else(job):
    local = "split.local=[pattern:body.block2.attn.*,head]"
    silos, server = federation(job, "fedper", "model.name=transformer", local)
    keys = set(silos[0].model.state_dict())
    personal = {k for k in keys if k.startswith(("body.block2.attn.", "head."))}
    assert len(personal) == 6
    for round_ in (1, 2):
        updates, state, evals = play_round(silos, server, round_, commit=True)
        assert all(set(u.delta) == keys - personal for u in updates)
        assert all(np.isfinite(e.val_loss) for e in evals)
    # Every silo holds the new global keys and its own attention.
    mine, theirs = (silo.model.state_dict() for silo in silos)
    assert all(np.array_equal(mine[k].numpy(), state[k]) for k in state)
    assert all(np.array_equal(theirs[k].numpy(), state[k]) for k in state)
    assert not torch.equal(
        mine["body.block2.attn.in_proj_weight"], theirs["body.block2.attn.in_proj_weight"]
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.hidden=[30,2,4]"], "model.hidden: transformer width 30 is not a multiple"),
        (["model.hidden=[32,2,2,2]"], "model.hidden: got [32, 2, 2, 2], expected [dim]"),
        (["model.hidden=[32,0]"], "model.hidden: got [32, 0], expected widths from 1 to 16384"),
        (["split.local=[last:5]"], "split.local[0]: last:5 asks for more blocks"),
        (["split.local=[pattern:body.block3.*]"], "matches no state_dict key"),
    ],
)
def test_a_bad_option_is_one_line_naming_the_key(job, overrides, message):
    with pytest.raises(ConfigError) as err:
        job("jobs/digits_label_skew.yaml", "model.name=transformer", *overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_inputs_neither_images_nor_vectors_are_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"model.name: transformer needs image inputs") as err:
        build_model("transformer", (4, 4), 2)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_every_algorithm_runs_a_round_of_the_transformer_or_refuses_in_one_line(job, algorithm):
    if ALGORITHMS[algorithm].__module__.startswith("tests."):
        pytest.skip("a test plugin's algorithm")
    if algorithm == "fedbn":  # its default rule, batchnorm, matches nothing here
        with pytest.raises(ConfigError, match="algorithm.name: fedbn keeps") as err:
            federation(job, algorithm, "model.name=transformer")
        assert "\n" not in str(err.value)
        return
    silos, server = federation(job, algorithm, "model.name=transformer")
    _, _, evals = play_round(silos, server, 1)
    assert all(np.isfinite(e.val_accuracy) for e in evals)
