"""The model zoo. Every model has a `body` and a `head`, so split rules read naturally.

`blocks(model)` lists the model's layers in forward order, the unit that `last:K` and `first:K`
split rules count: each module with its own parameters starts a block, and a normalisation layer
or an adapter belongs to the block before it.

With `model.adapter_dim` > 0, mlp, the cnn_small models and the transformer get a residual
bottleneck `Adapter` after each hidden layer (each encoder block) of the body (body.adapter1, ...),
found by the split rule `adapters`.

`transformer` (its parts in silo_pfl/transformer.py) is body.embed, body.block1, body.block2, ...
(pre-norm encoder blocks: norm1, attn, norm2, mlp), body.norm and a mean over tokens, then head;
each encoder block is one block of `blocks()`, its final LayerNorm belongs to the last one.

`MoEHead` replaces a model's Linear head by a mixture of expert heads (algorithm moe_heads).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch
from torch import nn

from silo_pfl import transformer as tf
from silo_pfl.errors import ConfigError

_NORM_TYPES = (nn.modules.batchnorm._BatchNorm, nn.GroupNorm, nn.LayerNorm)
ADAPTER_MODELS = ("mlp", "cnn_small", "cnn_small_bn", "transformer")


class Adapter(nn.Module):
    """x + up(relu(down(x))), a bottleneck of `dim` channels (1x1 convolutions on feature maps).

    `up` starts at zero, so a new adapter is the identity and the body computes what it did.
    """

    def __init__(self, width: int, dim: int, conv: bool) -> None:
        super().__init__()
        layer = (lambda i, o: nn.Conv2d(i, o, 1)) if conv else nn.Linear
        self.down = layer(width, dim)
        self.up = layer(dim, width)
        nn.init.zeros_(self.up.weight)
        nn.init.zeros_(self.up.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.up(torch.relu(self.down(x)))


class MoEHead(nn.Module):
    """A mixture of `experts` Linear heads, weighted per example by a gate on the body's features.

    Output: sum_e softmax(gate(x))_e * experts[e](x), a convex combination of the experts'
    logits (so one expert computes exactly what that Linear head does). Keys:
    head.experts.<e>.weight, head.experts.<e>.bias, head.gate.weight, head.gate.bias.
    """

    def __init__(self, in_features: int, num_classes: int, experts: int) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(in_features, num_classes) for _ in range(experts))
        self.gate = nn.Linear(in_features, experts)

    @classmethod
    def from_head(cls, head: nn.Module, experts: int, class_bias: float = 0.0) -> MoEHead:
        """A mixture whose expert 0 is `head` itself and whose other experts and gate are new
        (from torch's global generator, seeded by the caller). With more than one expert,
        `class_bias` is added to each expert's bias on its own classes: class c belongs to
        expert e when c % experts == e % num_classes, i.e. expert e favours class e when there
        are at least as many experts as classes, so the gate can choose classes through them."""
        if not isinstance(head, nn.Linear):
            raise ConfigError(
                f"model.name: the model's head is a {type(head).__name__}, not the single Linear "
                "layer a mixture of expert heads replaces"
            )
        moe = cls(head.in_features, head.out_features, experts)
        moe.experts[0] = head
        if experts > 1 and class_bias:
            classes = torch.arange(head.out_features)
            with torch.no_grad():
                for e, expert in enumerate(moe.experts):
                    expert.bias[classes % experts == e % head.out_features] += class_bias
        return moe

    def gates(self, x: torch.Tensor) -> torch.Tensor:
        """The mixture weights of each example of `x` (body features): rows summing to 1."""
        return torch.softmax(self.gate(x), dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = torch.stack([expert(x) for expert in self.experts], dim=1)
        return (self.gates(x).unsqueeze(2) * logits).sum(dim=1)


class BodyHeadModel(nn.Module):
    """A feature extractor `body` followed by a classifier `head`."""

    def __init__(self, body: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.body = body
        self.head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def check_adapters(name: str, adapter_dim: int) -> None:
    """model.adapter_dim must be >= 0, and > 0 only for a model that has adapters."""
    if adapter_dim < 0:
        raise ConfigError(f"model.adapter_dim: got {adapter_dim}, expected an integer >= 0")
    if adapter_dim and name not in ADAPTER_MODELS:
        raise ConfigError(
            f"model.adapter_dim: {name} has no adapters; use model.name "
            f"{', '.join(ADAPTER_MODELS)}, or model.adapter_dim=0"
        )


def check_hidden(name: str, hidden: Sequence[int]) -> None:
    """model.hidden as the model reads it: the transformer's [dim, depth, heads] (mlp's widths
    and the other models need nothing beyond widths >= 1)."""
    if name == "transformer":
        tf.transformer_shape(hidden)


def _adapter(name: str, width: int, dim: int, conv: bool) -> list[tuple[str, nn.Module]]:
    return [(name, Adapter(width, dim, conv))] if dim > 0 else []


def mlp(
    input_shape: Sequence[int], num_classes: int, hidden: Sequence[int], adapter_dim: int = 0
) -> BodyHeadModel:
    """Fully connected layers for tabular data: body.fc1, body.fc2, ..., then head."""
    layers: list[tuple[str, nn.Module]] = [("flatten", nn.Flatten())]
    width = math.prod(input_shape)
    for i, out in enumerate(hidden, start=1):
        layers += [(f"fc{i}", nn.Linear(width, out)), (f"relu{i}", nn.ReLU())]
        layers += _adapter(f"adapter{i}", out, adapter_dim, conv=False)
        width = out
    return BodyHeadModel(nn.Sequential(OrderedDict(layers)), nn.Linear(width, num_classes))


def _cnn_small(
    input_shape: Sequence[int], num_classes: int, batchnorm: bool, adapter_dim: int
) -> BodyHeadModel:
    channels = input_shape[0]

    def norm(name: str, width: int, kind: type[nn.Module]) -> list[tuple[str, nn.Module]]:
        return [(name, kind(width))] if batchnorm else []

    layers = [
        ("conv1", nn.Conv2d(channels, 16, 3, padding=1)),
        *norm("bn1", 16, nn.BatchNorm2d),
        ("relu1", nn.ReLU()),
        *_adapter("adapter1", 16, adapter_dim, conv=True),
        ("conv2", nn.Conv2d(16, 32, 3, padding=1)),
        *norm("bn2", 32, nn.BatchNorm2d),
        ("relu2", nn.ReLU()),
        *_adapter("adapter2", 32, adapter_dim, conv=True),
        ("pool", nn.AdaptiveAvgPool2d(2)),
        ("flatten", nn.Flatten()),
        ("fc", nn.Linear(128, 64)),
        *norm("bn3", 64, nn.BatchNorm1d),
        ("relu3", nn.ReLU()),
        *_adapter("adapter3", 64, adapter_dim, conv=False),
    ]
    return BodyHeadModel(nn.Sequential(OrderedDict(layers)), nn.Linear(64, num_classes))


def cnn_small(
    input_shape: Sequence[int], num_classes: int, hidden: Sequence[int], adapter_dim: int = 0
) -> BodyHeadModel:
    """conv 16, conv 32, pool 2x2, fc 64, head: for 8x8 digits."""
    return _cnn_small(input_shape, num_classes, batchnorm=False, adapter_dim=adapter_dim)


def cnn_small_bn(
    input_shape: Sequence[int], num_classes: int, hidden: Sequence[int], adapter_dim: int = 0
) -> BodyHeadModel:
    """cnn_small with BatchNorm after each layer of the body: the FedBN model."""
    return _cnn_small(input_shape, num_classes, batchnorm=True, adapter_dim=adapter_dim)


def resnet18(
    input_shape: Sequence[int], num_classes: int, hidden: Sequence[int], adapter_dim: int = 0
) -> BodyHeadModel:
    """torchvision's ResNet-18, adapted to 32x32 RGB (3x3 stem, no max-pool); no weights fetched."""
    from torchvision.models import resnet18 as tv_resnet18

    net = tv_resnet18(weights=None, num_classes=num_classes)
    net.conv1 = nn.Conv2d(input_shape[0], 64, 3, stride=1, padding=1, bias=False)
    body = nn.Sequential(
        OrderedDict(
            conv1=net.conv1,
            bn1=net.bn1,
            relu=net.relu,
            layer1=net.layer1,
            layer2=net.layer2,
            layer3=net.layer3,
            layer4=net.layer4,
            pool=net.avgpool,
            flatten=nn.Flatten(),
        )
    )
    return BodyHeadModel(body, net.fc)


def transformer(
    input_shape: Sequence[int], num_classes: int, hidden: Sequence[int], adapter_dim: int = 0
) -> BodyHeadModel:
    """A small pre-norm transformer encoder over patches (images) or features (vectors), mean
    over tokens, Linear head; model.hidden = [dim, depth, heads] (see silo_pfl.transformer)."""
    dim, depth, heads = tf.transformer_shape(hidden)
    layers: list[tuple[str, nn.Module]] = [("embed", tf.embedding(input_shape, dim))]
    for i in range(1, depth + 1):
        layers.append((f"block{i}", tf.EncoderBlock(dim, heads)))
        layers += _adapter(f"adapter{i}", dim, adapter_dim, conv=False)
    layers += [("norm", nn.LayerNorm(dim)), ("pool", tf.MeanTokens())]
    return BodyHeadModel(nn.Sequential(OrderedDict(layers)), nn.Linear(dim, num_classes))


ModelFactory = Callable[[Sequence[int], int, Sequence[int], int], BodyHeadModel]
MODELS: dict[str, ModelFactory] = {
    "mlp": mlp,
    "cnn_small": cnn_small,
    "cnn_small_bn": cnn_small_bn,
    "resnet18": resnet18,
    "transformer": transformer,
}
# The models whose head is one nn.Linear (tests build each to check), which MoEHead can replace.
IMAGE_MODELS = frozenset({"cnn_small", "cnn_small_bn", "resnet18"})  # convolutions over (C, H, W)
LINEAR_HEAD_MODELS = frozenset({"mlp", "cnn_small", "cnn_small_bn", "resnet18", "transformer"})


def build_model(
    name: str,
    input_shape: Sequence[int],
    num_classes: int,
    hidden: Sequence[int] = (32,),
    adapter_dim: int = 0,
) -> BodyHeadModel:
    """Build a model by name for inputs of `input_shape` and `num_classes` classes."""
    if name not in MODELS:
        raise ConfigError(f"model.name: got {name!r}, expected one of {', '.join(sorted(MODELS))}")
    check_adapters(name, adapter_dim)
    if name in IMAGE_MODELS and len(input_shape) != 3:
        raise ConfigError(f"model.name: {name} needs image inputs (C, H, W), got {input_shape}")
    return MODELS[name](tuple(input_shape), num_classes, tuple(hidden), adapter_dim)


def block_of(model: BodyHeadModel) -> dict[str, str]:
    """Map every top-level module (body.conv1, body.bn1, ..., head) to the block it belongs to."""
    owner: dict[str, str] = {}
    current = ""
    for name, module in model.body.named_children():
        has_params = any(True for _ in module.parameters())
        if has_params and not (isinstance(module, (*_NORM_TYPES, Adapter)) and current):
            current = f"body.{name}"
        owner[f"body.{name}"] = current or f"body.{name}"
    owner["head"] = "head"
    return owner


def blocks(model: BodyHeadModel) -> list[str]:
    """The model's layers that hold state, in forward order, e.g. body.conv1, body.conv2, body.fc,
    head (a leading module without state, such as mlp's flatten, is no block)."""
    owner = block_of(model)
    holding = {owner.get(".".join(key.split(".")[:2]), "head") for key in model.state_dict()}
    return [block for block in dict.fromkeys(owner.values()) if block in holding]
