"""Lay out each hospital's rows in a directory of its own, as if on that hospital's node.

    python cluster/hospital_data.py DATA_ROOT [cleveland hungarian ...]

writes DATA_ROOT/<hospital>/heart.csv, for every hospital if none is named (the ten raw columns
of UCI Heart Disease and `label`), from the data shipped in the package. Start the cluster with
`--data-root DATA_ROOT`, and each silo's node finds its own file as $SILO_PFL_DATA_DIR/heart.csv
(jobs/hospitals_on_nodes.yaml).
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

from silo_pfl.data.heart_disease import RAW_COLUMNS, SILOS, read_complete_rows

FILE_NAME = "heart.csv"


def write_hospital(root: Path, hospital: str) -> Path:
    """DATA_ROOT/<hospital>/heart.csv: a header row, then one row per complete record."""
    rows, labels = read_complete_rows(hospital)
    path = root / hospital / FILE_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow([*RAW_COLUMNS, "label"])
        for row, label in zip(rows, labels, strict=True):
            writer.writerow([f"{v:g}" for v in row] + [int(label)])
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data_root", type=Path)
    # No `choices`: argparse checks a positional's empty list against them, and refuses it.
    parser.add_argument("hospitals", nargs="*", metavar="HOSPITAL", help="default: all of them")
    args = parser.parse_args()
    unknown = [hospital for hospital in args.hospitals if hospital not in SILOS]
    if unknown:
        print(f"error: HOSPITAL: got {unknown[0]!r}, expected {', '.join(SILOS)}", file=sys.stderr)
        sys.exit(2)
    for hospital in args.hospitals or SILOS:
        print(write_hospital(args.data_root, hospital))


if __name__ == "__main__":
    main()
