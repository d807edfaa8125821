"""Pure-numpy ways to share labelled rows among silos and to hold rows out of a silo's split.

Every function takes an explicit numpy Generator, so the result depends only on its arguments and
the seed that built the generator. Index arrays come back sorted ascending.
"""

from __future__ import annotations

import math

import numpy as np

from silo_pfl.errors import ConfigError

PARTITIONS = ("iid", "dirichlet", "pathological", "concept_shift", "feature_shift")
DIRICHLET_MIN_ROWS = 10
DIRICHLET_MAX_DRAWS = 300


def holdout_size(num_rows: int, fraction: float) -> int:
    """Rows to hold out: round(fraction * num_rows), at least 1 and leaving at least 1 behind.

    No rows are held out when `fraction` is 0 or there are fewer than 2 rows.
    """
    if fraction <= 0 or num_rows < 2:
        return 0
    return min(max(1, round(fraction * num_rows)), num_rows - 1)


def _class_quotas(counts: np.ndarray, total: int) -> np.ndarray:
    """Split `total` over classes in proportion to `counts` (largest remainder, ties by order)."""
    exact = counts * total / counts.sum()
    quotas = np.floor(exact).astype(np.int64)
    extra = total - int(quotas.sum())
    order = np.argsort(-(exact - quotas), kind="stable")
    quotas[order[:extra]] += 1
    return quotas


def holdout(
    labels: np.ndarray, fraction: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Split row positions into (kept, held out), stratified by label, `holdout_size` held out."""
    num_rows = len(labels)
    size = holdout_size(num_rows, fraction)
    if size == 0:
        return np.arange(num_rows), np.empty(0, dtype=np.int64)
    classes, counts = np.unique(labels, return_counts=True)
    held = [
        rng.permutation(np.flatnonzero(labels == label))[:quota]
        for label, quota in zip(classes, _class_quotas(counts, size), strict=True)
    ]
    held_rows = np.sort(np.concatenate(held))
    return np.setdiff1d(np.arange(num_rows), held_rows), held_rows


def iid(labels: np.ndarray, num_silos: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Shuffle the rows and deal them into `num_silos` parts of (nearly) equal size."""
    parts = np.array_split(rng.permutation(len(labels)), num_silos)
    return [np.sort(part) for part in parts]


def _dirichlet_draw(
    labels: np.ndarray, num_silos: int, alpha: float, rng: np.random.Generator
) -> list[np.ndarray]:
    """One draw: each class's rows split over silos by Dirichlet(alpha) proportions.

    Silos already holding their equal share get no more rows (the usual balancing rule), which
    keeps silo sizes workable without weakening the label skew.
    """
    share = len(labels) / num_silos
    parts: list[list[np.ndarray]] = [[] for _ in range(num_silos)]
    sizes = np.zeros(num_silos, dtype=np.int64)
    for label in np.unique(labels):
        rows = rng.permutation(np.flatnonzero(labels == label))
        open_ = sizes < share
        proportions = rng.dirichlet(np.full(num_silos, alpha)) * open_
        total = proportions.sum()
        if total == 0:  # tiny alpha: every open silo drew exactly 0; spread over them alike
            proportions, total = open_.astype(np.float64), max(int(open_.sum()), 1)
        proportions = proportions / total
        cuts = (np.cumsum(proportions) * len(rows)).astype(np.int64)[:-1]
        for silo, chunk in enumerate(np.split(rows, cuts)):
            parts[silo].append(chunk)
            sizes[silo] += len(chunk)
    return [np.sort(np.concatenate(chunks)) for chunks in parts]


def dirichlet(
    labels: np.ndarray,
    num_silos: int,
    alpha: float,
    rng: np.random.Generator,
    min_rows: int = DIRICHLET_MIN_ROWS,
) -> list[np.ndarray]:
    """Label-skewed partition: per-class Dirichlet(alpha) shares over the silos.

    Re-drawn (from the same generator) until every silo has at least
    max(2, min(min_rows, rows // (4 * num_silos))) rows; very small alpha with many silos may
    never get there, which is a ConfigError.
    """
    needed = max(2, min(min_rows, len(labels) // (4 * num_silos)))
    for _ in range(DIRICHLET_MAX_DRAWS):
        parts = _dirichlet_draw(labels, num_silos, alpha, rng)
        if min(len(part) for part in parts) >= needed:
            return parts
    raise ConfigError(
        f"data.alpha: {alpha} with data.num_silos={num_silos} left some silo with fewer than "
        f"{needed} rows in {DIRICHLET_MAX_DRAWS} draws; raise data.alpha or lower data.num_silos"
    )


def _pick_classes(remaining: np.ndarray, count: int, rng: np.random.Generator) -> np.ndarray:
    """The `count` classes with the most shards left, ties broken at random."""
    order = np.lexsort((rng.random(len(remaining)), -remaining))
    return order[:count]


def pathological(
    labels: np.ndarray, num_silos: int, classes_per_silo: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """Shard partition: each silo gets `classes_per_silo` shards, each of a different class.

    Every class is cut into about num_silos * classes_per_silo / num_classes shards of its own
    rows (shards never mix classes), so each silo holds exactly `classes_per_silo` classes.
    """
    classes = np.unique(labels)
    num_shards = num_silos * classes_per_silo
    if classes_per_silo > len(classes) or num_shards < len(classes):
        raise ConfigError(
            f"data.classes_per_silo: got {classes_per_silo} with data.num_silos={num_silos} and "
            f"{len(classes)} classes, expected <= {len(classes)} and num_silos * classes_per_silo "
            f">= {len(classes)}"
        )
    shard_counts = np.full(len(classes), num_shards // len(classes))
    shard_counts[rng.permutation(len(classes))[: num_shards % len(classes)]] += 1
    shards = [
        list(np.array_split(rng.permutation(np.flatnonzero(labels == label)), count))
        for label, count in zip(classes, shard_counts, strict=True)
    ]
    if any(len(shard) == 0 for class_shards in shards for shard in class_shards):
        raise ConfigError(
            f"data.num_silos: {num_silos} silos x {classes_per_silo} classes needs more rows per "
            "class than there are; lower data.num_silos or data.classes_per_silo"
        )
    remaining = shard_counts.copy()
    parts = []
    for _ in range(num_silos):
        picked = _pick_classes(remaining, classes_per_silo, rng)
        remaining[picked] -= 1
        parts.append(np.sort(np.concatenate([shards[c][remaining[c]] for c in picked])))
    return parts


def label_permutations(num_silos: int, num_classes: int, rng: np.random.Generator) -> np.ndarray:
    """One random label permutation per silo (row s maps label y to row[y]), all different.

    Every silo, silo 0 included, draws its permutation; when there are fewer permutations than
    silos (tiny class counts), repeats are unavoidable and allowed.
    """
    limit = math.factorial(num_classes)
    seen: set[tuple[int, ...]] = set()
    perms = []
    while len(perms) < num_silos:
        perm = rng.permutation(num_classes)
        key = tuple(perm.tolist())
        if key in seen and len(seen) < limit:
            continue
        seen.add(key)
        perms.append(perm)
    return np.stack(perms).astype(np.int64)
