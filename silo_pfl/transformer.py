"""The parts of the zoo's small transformer (model.name=transformer), from torch's own modules.

Inputs become tokens, then pre-norm encoder blocks, a final LayerNorm and the mean over tokens:

- an image (C, H, W) is cut into square patches of `patch_size(H, W)` pixels, 4x4 where 4
  divides both sides (4 tokens on 8x8 digits, 64 on 32x32 images), each embedded by a strided
  Conv2d (`body.embed.proj`);
- a feature vector (F,) gives one token per feature: value * w_f + b_f, each feature with its
  own w_f and b_f (a grouped 1x1 Conv1d, `body.embed.proj`);
- either way a learned position embedding is added (`body.embed.pos`: one vector per patch, or
  per feature: the feature's own embedding).

The key names are the same for images and feature vectors (only their shapes differ), so a split
rule checked on one input shape holds for the other. `model.hidden` is [dim, depth, heads]:
the token width, the number of encoder blocks (default 2) and of attention heads (default dim / 16,
at least 1); dim must be a multiple of heads.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from silo_pfl.errors import ConfigError

DEFAULT_DEPTH = 2
HEAD_WIDTH = 16  # channels per attention head when model.hidden gives no head count
MLP_RATIO = 2  # the width of each block's MLP, in multiples of dim
PATCH = 4  # images: the side of a square patch (the largest divisor of both sides up to it)


def transformer_shape(hidden: Sequence[int]) -> tuple[int, int, int]:
    """(dim, depth, heads) from model.hidden = [dim] | [dim, depth] | [dim, depth, heads]."""
    values = [int(v) for v in hidden]
    if not 1 <= len(values) <= 3 or min(values) < 1:
        raise ConfigError(
            f"model.hidden: got {values}, expected [dim], [dim, depth] or [dim, depth, heads] "
            "for model transformer, each >= 1, e.g. [32, 2, 2]"
        )
    dim = values[0]
    depth = values[1] if len(values) > 1 else DEFAULT_DEPTH
    heads = values[2] if len(values) > 2 else max(1, dim // HEAD_WIDTH)
    if dim % heads:
        raise ConfigError(
            f"model.hidden: transformer width {dim} is not a multiple of its {heads} attention "
            f"heads; choose a width that is, e.g. [{heads * max(1, dim // heads)}, {depth}, "
            f"{heads}]"
        )
    return dim, depth, heads


def patch_size(height: int, width: int) -> int:
    """The side of the square patches an image is cut into: the largest number up to PATCH that
    divides both its height and its width."""
    return max(p for p in range(1, PATCH + 1) if height % p == 0 and width % p == 0)


class PatchEmbedding(nn.Module):
    """(B, C, H, W) -> (B, tokens, dim): a strided convolution over square patches, plus a
    learned position embedding per patch."""

    def __init__(self, input_shape: Sequence[int], dim: int) -> None:
        super().__init__()
        channels, height, width = input_shape
        p = patch_size(height, width)
        self.proj = nn.Conv2d(channels, dim, p, stride=p)
        self.pos = nn.Parameter(torch.randn(height // p * (width // p), dim) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2) + self.pos


class FeatureEmbedding(nn.Module):
    """(B, F) -> (B, F, dim): feature f becomes x_f * w_f + b_f (a 1x1 convolution with one group
    per feature), plus the feature's learned embedding."""

    def __init__(self, features: int, dim: int) -> None:
        super().__init__()
        self.features, self.dim = features, dim
        self.proj = nn.Conv1d(features, features * dim, 1, groups=features)
        self.pos = nn.Parameter(torch.randn(features, dim) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.proj(x.reshape(len(x), self.features, 1))
        return tokens.reshape(len(x), self.features, self.dim) + self.pos


def embedding(input_shape: Sequence[int], dim: int) -> nn.Module:
    """The token embedding for images (C, H, W) or feature vectors (F,)."""
    if len(input_shape) == 3:
        return PatchEmbedding(input_shape, dim)
    if len(input_shape) == 1:
        return FeatureEmbedding(input_shape[0], dim)
    raise ConfigError(
        f"model.name: transformer needs image inputs (C, H, W) or a feature vector (F,), "
        f"got inputs of shape {tuple(input_shape)}"
    )


class EncoderBlock(nn.Module):
    """Pre-norm encoder block: x + attn(norm1(x)), then x + mlp(norm2(x)); no dropout."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential()
        self.mlp.add_module("fc1", nn.Linear(dim, MLP_RATIO * dim))
        self.mlp.add_module("act", nn.GELU())
        self.mlp.add_module("fc2", nn.Linear(MLP_RATIO * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class MeanTokens(nn.Module):
    """(B, tokens, dim) -> (B, dim): the mean token, what the head reads."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=1)
