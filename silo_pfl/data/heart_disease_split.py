"""Write FLamby's heart-disease train/test split to `heart_disease/flamby_split.json`.

Run once, by a maintainer, with scikit-learn installed:

    python -m silo_pfl.data.heart_disease_split

It calls sklearn's train_test_split exactly as FLamby's `fed_heart_disease/dataset.py` does, so
the silos can read the split without importing sklearn.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from silo_pfl.data.heart_disease import SILOS, SPLIT_FILE, read_complete_rows

TRAIN_FRACTION = 0.66
RANDOM_STATE = 43
DESCRIPTION = (
    "FLamby fed_heart_disease split: for each hospital, sklearn train_test_split(np.arange(n), "
    "train_size=0.66, test_size=0.34, random_state=43, shuffle=True, stratify=binary label "
    "(num > 0) unless some class has 2 or fewer rows). Indices are 0-based positions in the "
    "hospital's complete rows (columns 10-12 dropped, then rows with a missing value dropped), "
    "sorted ascending as FLamby keeps them."
)


def split_indices(labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """FLamby's (train, test) positions for one hospital's binary labels, sorted ascending."""
    from sklearn.model_selection import train_test_split

    levels, counts = np.unique(labels, return_counts=True)
    stratify = labels if len(levels) > 1 and (counts > 2).all() else None
    train, test = train_test_split(
        np.arange(len(labels)),
        test_size=1.0 - TRAIN_FRACTION,
        train_size=TRAIN_FRACTION,
        random_state=RANDOM_STATE,
        shuffle=True,
        stratify=stratify,
    )
    return np.sort(train), np.sort(test)


def build_split() -> dict:
    """The JSON document: the description and every hospital's train and test indices."""
    hospitals = {}
    for silo in SILOS:
        train, test = split_indices(read_complete_rows(silo)[1])
        hospitals[silo] = {"train": train.tolist(), "test": test.tolist()}
    return {"description": DESCRIPTION, "hospitals": hospitals}


def to_json(split: dict) -> str:
    """Readable JSON with one line per index list."""
    lines = ["{", f'  "description": {json.dumps(split["description"])},', '  "hospitals": {']
    hospitals = list(split["hospitals"].items())
    for i, (silo, rows) in enumerate(hospitals):
        lines.append(f'    "{silo}": {{')
        lines.append(f'      "train": {json.dumps(rows["train"])},')
        lines.append(f'      "test": {json.dumps(rows["test"])}')
        lines.append("    }" + ("," if i < len(hospitals) - 1 else ""))
    lines += ["  }", "}"]
    return "\n".join(lines) + "\n"


def main(path: Path = SPLIT_FILE) -> None:
    """Write the split file and report the sizes."""
    split = build_split()
    path.write_text(to_json(split))
    for silo, rows in split["hospitals"].items():
        print(f"{silo}: {len(rows['train'])} train, {len(rows['test'])} test")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
