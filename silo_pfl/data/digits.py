"""The 8x8 handwritten digits bundled with scikit-learn, shared among `data.num_silos` silos.

1797 greyscale images of the digits 0-9, scaled to [0, 1], one (1, 8, 8) array per example. The
file is read with numpy from scikit-learn's package directory, so silos never import sklearn.

Every silo computes the same global partition from the seed and keeps its own share:

- iid: rows dealt at random, equal sizes.
- dirichlet: per-class Dirichlet(data.alpha) shares (see `partitioners.dirichlet`).
- pathological: data.classes_per_silo classes per silo, by class-pure shards.
- concept_shift: iid rows; each silo (silo_0 included) relabels ALL its rows - train, val and
  test - with its own random permutation of the 10 classes, all permutations different.
- feature_shift: iid rows; each silo transforms ALL its images with its own contrast,
  brightness, fixed per-image gaussian noise and a rotation by 90/180/270 or a flip.

Images are then standardised with the fixed, public mean and std of the whole digits set
(`PIXEL_MEAN`, `PIXEL_STD`, like MNIST's usual constants); no silo's statistics are shared.
data.image_shape=[C, S, S] (default [1, 8, 8]) hands the models larger images, e.g. [3, 32, 32]
for a network sized for CIFAR: each pixel repeated S/8 times along both axes, the grey repeated
in each of the C channels. Nothing is added: the same digits, at a network's input size.

iid, concept_shift and feature_shift draw the same rows for a seed, so they differ only by the
shift. Each silo then holds out data.test_fraction of its rows for test and data.val_fraction of
the rest for validation, both stratified by label.
"""

from __future__ import annotations

import functools
import importlib.util
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from silo_pfl.config import DataConfig
from silo_pfl.data import partitioners
from silo_pfl.data.base import Preprocessing, SiloData, assemble
from silo_pfl.errors import ConfigError, DataError, one_line
from silo_pfl.seeding import numpy_rng

NUM_IMAGES = 1797
NUM_CLASSES = 10
# 14 rows allow 128 silos; with the pathological partition's 2 classes each, a silo's 12-16 rows
# still give it train, validation and test rows of both its classes (tests/data/test_digits.py).
MIN_ROWS_PER_SILO = 14
MAX_SILOS = NUM_IMAGES // MIN_ROWS_PER_SILO
# Mean and std of all 1797 images scaled to [0, 1]: fixed constants of the public dataset.
PIXEL_MEAN = 0.3053
PIXEL_STD = 0.3760
GEOMETRIES = ("rot90", "rot180", "rot270", "flip_lr", "flip_ud")
# Raw layout of a served model: the silo's own image (after its feature shift, at
# data.image_shape), row-major: pixel_0 .. pixel_{C*S*S-1}.
IMAGE_SHAPE = (1, 8, 8)
MAX_SIDE = 256  # the largest upsampled side: 1797 digits at 3x256x256 are 1.4 GB of float32
CHANNELS = (1, 3)  # grey, or grey repeated as RGB


@dataclass(frozen=True)
class FeatureShift:
    """One silo's fixed input transformation for the feature_shift partition."""

    contrast: float  # scales pixel values around 0.5, in [0.5, 1.5]
    brightness: float  # added to every pixel, in [-0.2, 0.2]
    noise_std: float  # std of the fixed gaussian noise per image, in [0.02, 0.1]
    geometry: str  # one of GEOMETRIES


@dataclass
class Params(DataConfig):
    """data.* of data.source=digits."""

    test_fraction: float = 0.25  # share of each silo's rows held out for test
    num_silos: int = 10  # how many silos share the images
    partition: str = "iid"  # iid | dirichlet | pathological | concept_shift | feature_shift
    alpha: float = 0.5  # dirichlet: concentration; smaller is more skewed
    classes_per_silo: int = 2  # pathological: classes each silo holds
    # [C, S, S]: the images upsampled to S x S (S a multiple of 8) in C channels (1 or 3)
    image_shape: list[int] = field(default_factory=lambda: list(IMAGE_SHAPE))


def validate(cfg: Params) -> None:
    """Check the digits keys of the config."""
    if not 1 <= cfg.num_silos <= MAX_SILOS:
        raise ConfigError(
            f"data.num_silos: got {cfg.num_silos}, expected 1 <= value <= {MAX_SILOS} "
            f"(at least {MIN_ROWS_PER_SILO} of the {NUM_IMAGES} digits per silo)"
        )
    if cfg.partition not in partitioners.PARTITIONS:
        raise ConfigError(
            f"data.partition: got {cfg.partition!r}, expected one of "
            f"{', '.join(partitioners.PARTITIONS)}"
        )
    if not (cfg.alpha > 0 and math.isfinite(cfg.alpha)):
        raise ConfigError(
            f"data.alpha: got {cfg.alpha}, expected a finite number > 0 (a large one, e.g. "
            "1000, splits every class nearly evenly)"
        )
    if not 1 <= cfg.classes_per_silo <= NUM_CLASSES:
        raise ConfigError(
            f"data.classes_per_silo: got {cfg.classes_per_silo}, expected 1 <= value <= "
            f"{NUM_CLASSES}"
        )
    if cfg.partition == "pathological" and cfg.num_silos * cfg.classes_per_silo < NUM_CLASSES:
        raise ConfigError(
            f"data.classes_per_silo: got {cfg.classes_per_silo} with data.num_silos="
            f"{cfg.num_silos}, expected num_silos * classes_per_silo >= {NUM_CLASSES} so that "
            "every digit is held by some silo"
        )
    shape = list(cfg.image_shape)
    if not (
        len(shape) == 3
        and shape[0] in CHANNELS
        and shape[1] == shape[2]
        and 8 <= shape[1] <= MAX_SIDE
        and shape[1] % 8 == 0
    ):
        raise ConfigError(
            f"data.image_shape: got {shape}, expected [C, S, S] with C 1 or 3 and S a multiple "
            f"of 8 up to {MAX_SIDE} (the 8x8 digits, each pixel repeated S/8 times)"
        )


def image_shape_of(width: int) -> tuple[int, int, int] | None:
    """The (C, S, S) of raw rows `width` pixels wide (C 1 or 3, S a multiple of 8), or None."""
    for channels in CHANNELS:
        size = math.isqrt(width // channels)
        if channels * size * size == width and size >= 8 and size % 8 == 0:
            return channels, size, size
    return None


def upsample(images: np.ndarray, shape: tuple[int, ...] | list[int]) -> np.ndarray:
    """Images (n, 1, 8, 8) as (n, C, S, S): each pixel repeated S/8 times along both axes, the
    grey repeated in every channel."""
    channels, size = shape[0], shape[1]
    factor = size // IMAGE_SHAPE[1]
    grey = images.repeat(factor, axis=-2).repeat(factor, axis=-1)
    return np.ascontiguousarray(np.broadcast_to(grey, (len(images), channels, size, size)))


def pixel_columns(width: int) -> tuple[str, ...]:
    """pixel_0 .. pixel_{width-1}: the raw columns of images `width` pixels wide."""
    return tuple(f"pixel_{i}" for i in range(width))


def encode_raw(rows: np.ndarray) -> np.ndarray:
    """Map raw rows (n, C*S*S) of pixel_0.. in [0, 1] to images (n, C, S, S): (n, 64) to
    (n, 1, 8, 8), (n, 3072) to (n, 3, 32, 32). A pixel outside [0, 1] is a DataError."""
    rows = np.asarray(rows, dtype=np.float32)
    shape = image_shape_of(rows.shape[1]) if rows.ndim == 2 else None
    if shape is None:
        raise DataError(
            f"digits raw rows: got shape {rows.shape}, expected (n, C*S*S) with columns "
            "pixel_0.. in [0, 1], C 1 or 3 and S a multiple of 8 (64 for the 8x8 digits)"
        )
    outside = ~((rows >= 0.0) & (rows <= 1.0))  # NaN is outside too
    if outside.any():
        row, column = (int(i[0]) for i in np.nonzero(outside))
        raise DataError(
            f"digits raw rows: column pixel_{column} has {rows[row, column]:g} (row {row}), "
            "expected a pixel value in [0, 1] (the digits' 0..16 divided by 16)"
        )
    return rows.reshape(-1, *shape)


def input_shape(cfg: Params) -> tuple[int, ...]:
    """The shape of one silo's inputs, known at load: data.image_shape."""
    return tuple(cfg.image_shape)


def silo_names(cfg: Params) -> list[str]:
    """silo_0 .. silo_{N-1}."""
    return [f"silo_{i}" for i in range(cfg.num_silos)]


def digits_file() -> Path | None:
    """scikit-learn's bundled digits.csv.gz, found without importing sklearn; None if absent."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        path = Path(location) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            return path
    return None


@functools.lru_cache(maxsize=1)
def _read(path: Path) -> tuple[np.ndarray, np.ndarray]:
    table = np.loadtxt(path, delimiter=",", dtype=np.float32)
    images = (table[:, :-1] / 16.0).reshape(-1, 1, 8, 8).astype(np.float32)
    return images, table[:, -1].astype(np.int64)


def read_digits(silo: str = "?") -> tuple[np.ndarray, np.ndarray]:
    """All images, shape (1797, 1, 8, 8) in [0, 1], and their labels 0-9."""
    path = digits_file()
    if path is None:
        raise DataError(
            f"silo {silo}: the digits source reads sklearn/datasets/data/digits.csv.gz, but "
            "scikit-learn is not installed or lacks that file (pip install scikit-learn)"
        )
    try:
        images, labels = _read(path)
    except (OSError, ValueError) as exc:
        reason = one_line(exc)
        raise DataError(f"silo {silo}: cannot read digits file {path}: {reason}") from None
    if images.shape[0] != NUM_IMAGES:
        raise DataError(
            f"silo {silo}: digits file {path} has {images.shape[0]} rows, expected {NUM_IMAGES}"
        )
    return images, labels


def partition(cfg: Params, labels: np.ndarray, seed: int) -> list[np.ndarray]:
    """Row indices of every silo, in silo order; the same in every process for a seed."""
    if cfg.partition == "dirichlet":
        rng = numpy_rng(seed, "partition", "dirichlet")
        return partitioners.dirichlet(labels, cfg.num_silos, cfg.alpha, rng)
    if cfg.partition == "pathological":
        rng = numpy_rng(seed, "partition", "pathological")
        return partitioners.pathological(labels, cfg.num_silos, cfg.classes_per_silo, rng)
    return partitioners.iid(labels, cfg.num_silos, numpy_rng(seed, "partition", "iid"))


def check_partition(cfg: Params, seed: int) -> None:
    """On the driver, before Ray starts: a Dirichlet partition the seed cannot make (data.alpha
    too small for data.num_silos) is a ConfigError now, not once every silo has started."""
    if cfg.partition == "dirichlet":
        partition(cfg, read_digits()[1], seed)


def label_permutations(cfg: Params, seed: int) -> np.ndarray:
    """concept_shift: row s is silo_s's map from true digit to the label it uses."""
    rng = numpy_rng(seed, "concept_shift")
    return partitioners.label_permutations(cfg.num_silos, NUM_CLASSES, rng)


def feature_shift(seed: int, silo: str) -> FeatureShift:
    """feature_shift: the silo's transformation, fixed by the seed and the silo name."""
    rng = numpy_rng(seed, "feature_shift", silo)
    return FeatureShift(
        contrast=float(rng.uniform(0.5, 1.5)),
        brightness=float(rng.uniform(-0.2, 0.2)),
        noise_std=float(rng.uniform(0.02, 0.1)),
        geometry=str(GEOMETRIES[rng.integers(len(GEOMETRIES))]),
    )


def _apply_geometry(images: np.ndarray, geometry: str) -> np.ndarray:
    if geometry.startswith("rot"):
        return np.rot90(images, k=int(geometry[3:]) // 90, axes=(-2, -1))
    return np.flip(images, axis=-1 if geometry == "flip_lr" else -2)


def apply_feature_shift(
    images: np.ndarray, shift: FeatureShift, rng: np.random.Generator
) -> np.ndarray:
    """Transform images (n, 1, 8, 8) in [0, 1]; the noise comes from `rng`, one draw per pixel."""
    noise = rng.normal(0.0, shift.noise_std, size=images.shape)
    shifted = shift.contrast * (images - 0.5) + 0.5 + shift.brightness + noise
    shifted = _apply_geometry(np.clip(shifted, 0.0, 1.0), shift.geometry)
    return np.ascontiguousarray(shifted, dtype=np.float32)


def _silo_index(cfg: Params, silo: str) -> int:
    names = silo_names(cfg)
    if silo not in names:
        raise DataError(
            f"silo {silo}: not a digits silo; expected one of silo_0..silo_{cfg.num_silos - 1} "
            f"(data.num_silos={cfg.num_silos})"
        )
    return names.index(silo)


def _silo_rows(cfg: Params, silo: str, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The silo's images, feature shift applied, at data.image_shape, and their true digits."""
    images, labels = read_digits(silo)
    rows = partition(cfg, labels, seed)[_silo_index(cfg, silo)]
    x, digit = images[rows], labels[rows]
    if cfg.partition == "feature_shift":
        noise_rng = numpy_rng(seed, "feature_shift_noise", silo)
        x = apply_feature_shift(x, feature_shift(seed, silo), noise_rng)
    if len(digit) < 2:
        raise DataError(
            f"silo {silo}: data.partition={cfg.partition} gave it {len(digit)} digits rows, need "
            "at least 2 for train and test; lower data.num_silos"
        )
    if tuple(cfg.image_shape) != IMAGE_SHAPE:
        x = upsample(x, cfg.image_shape)
    return x, digit


def load(cfg: Params, silo: str, seed: int) -> SiloData:
    """This silo's share of the digits, split into train, validation and test.

    The splits are stratified on the true digit, so concept_shift holds the same rows in the same
    splits as iid and only the labels differ.
    """
    index = _silo_index(cfg, silo)
    x, digit = _silo_rows(cfg, silo, seed)
    y = digit
    if cfg.partition == "concept_shift":
        y = label_permutations(cfg, seed)[index][digit]
    train, test = partitioners.holdout(digit, cfg.test_fraction, numpy_rng(seed, "test", silo))
    return assemble(
        silo,
        x,
        y,
        train,
        test,
        cfg.val_fraction,
        seed,
        strata=digit,
        preprocessing=Preprocessing(mean=(PIXEL_MEAN,), std=(PIXEL_STD,)),
        max_train_rows=cfg.max_train_rows,
        num_classes=NUM_CLASSES,
        raw_columns=pixel_columns(int(np.prod(x.shape[1:]))),
        x_test_raw=x[test].reshape(len(test), -1),
    )
