"""The fixed-point encoding of a weighted update as integers modulo 2^64, and its decoding."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from silo_pfl.errors import FederationError

FRACTION_BITS = 24  # a value v is sent as round(v * 2^24) modulo 2^64
SCALE = float(1 << FRACTION_BITS)
RESOLUTION = 1.0 / SCALE  # the least value a silo of one row sends as other than 0 (about 6e-8)
SUM_BITS = 62  # the sum over every silo stays below 2^62 in magnitude: it never wraps
BLOCK_VALUES = 1 << 16  # values encoded at a time: 512 KiB of float64, in a core's cache


def bound(parties: int) -> float:
    """The largest |weight * value| one of `parties` silos may send."""
    return 2.0 ** (SUM_BITS - FRACTION_BITS) / parties


def encode(
    payload: Mapping[str, np.ndarray],
    weight: int,
    parties: int,
    silo: str,
    clip: float | None = None,
) -> np.ndarray:
    """weight * payload (keys in sorted order, flattened) in fixed point, then the weight, as
    uint64. `clip` first bounds each value to [-clip, clip]. A value outside the encodable range
    (see `bound`) is an error naming the silo, never a silent wrap. Works block by block in
    float64, straight from each array: each block is converted and scaled in one pass, checked
    and rounded while it is in cache."""
    parts = [np.asarray(payload[k]).ravel() for k in sorted(payload)]
    size = sum(part.size for part in parts)
    encoded = np.empty(size + 1, dtype=np.int64)
    scale, limit = float(weight) * SCALE, bound(parties) * SCALE
    block = np.empty(min(BLOCK_VALUES, size), dtype=np.float64)
    at = 0
    for part in parts:
        for start in range(0, part.size, BLOCK_VALUES):
            source = part[start : start + BLOCK_VALUES]
            values = block[: source.size]
            if clip is not None:
                np.clip(source, -clip, clip, out=values, dtype=np.float64)
                values *= scale
            else:
                np.multiply(source, scale, out=values, dtype=np.float64)
            if not (-limit < float(values.min()) and float(values.max()) < limit):
                _out_of_range(parts, weight, parties, silo, clip)
            np.rint(values, out=values)
            encoded[at : at + values.size] = values
            at += values.size
    encoded[-1] = weight
    return encoded.view(np.uint64)


def _out_of_range(
    parts: list[np.ndarray], weight: int, parties: int, silo: str, clip: float | None
) -> None:
    """The one-line error for an update outside the fixed-point range. It quotes none of the
    update's values: the line reaches the driver, which secure aggregation keeps them from."""
    fix = (
        f"lower aggregation.clip below {bound(parties) / weight:.3g} for this silo's {weight} rows"
        if clip is not None
        else "set aggregation.clip"
    )
    raise FederationError(
        f"silo {silo}: its weighted update leaves secure aggregation's fixed-point range "
        f"(|num_examples x value| < {bound(parties):.3g} for {parties} silos, or a value is "
        f"not finite); {fix}, or lower train.lr"
    )


def vector_length(shapes: Mapping[str, tuple[int, ...]]) -> int:
    """Entries in one masked vector: every value, then the weight."""
    return sum(int(np.prod(shape, dtype=np.int64)) for shape in shapes.values()) + 1


def decoded_weight(total: np.ndarray) -> int:
    """From the unmasked sum of the silos' vectors, the sum of their weights, sum(w_i)."""
    weight = int(total.view(np.int64)[-1])
    if weight < 1:
        raise ValueError(f"secure aggregation: the weights sum to {weight}, expected >= 1")
    return weight


def decode_mean(total: np.ndarray, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """From the unmasked sum of the silos' vectors, sum(w_i * x_i) / sum(w_i) per key (float64)."""
    signed = total.view(np.int64)
    weight = decoded_weight(total)
    flat = signed[:-1].astype(np.float64)
    flat /= SCALE * weight
    mean, start = {}, 0
    for key in sorted(shapes):
        size = int(np.prod(shapes[key], dtype=np.int64))
        mean[key] = flat[start : start + size].reshape(shapes[key])
        start += size
    if start != flat.size:
        raise ValueError(f"secure aggregation: {flat.size} values for {start} expected")
    return mean
