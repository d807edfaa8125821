"""Reading one silo's CSV: numpy's C reader (the path a well-formed file takes) against reading
it cell by cell (the path that names a bad cell's row and column), on the same file, in one run.

    python benchmarks/csv_read.py [--rows 500000] [--features 10] [--repeats 3]

Prints each path's best wall time and its peak traced memory (tracemalloc: Python objects and
numpy's buffers), and the ratios. Both paths must give the same arrays.
"""

from __future__ import annotations

import argparse
import csv
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from silo_pfl.data.csv_source import _Table


def _write(path: Path, rows: int, features: int) -> None:
    rng = np.random.default_rng(0)
    values = rng.normal(size=(rows, features))
    labels = rng.integers(0, 2, size=rows)
    header = ",".join([f"f{i}" for i in range(features)] + ["label"])
    body = np.column_stack([values, labels])
    fmt = ["%.6f"] * features + ["%d"]
    np.savetxt(path, body, delimiter=",", header=header, comments="", fmt=fmt)


def _measure(read: Callable[[], Any], repeats: int) -> tuple[float, int, Any]:
    best, result = float("inf"), None
    for _ in range(repeats):
        began = time.perf_counter()
        result = read()
        best = min(best, time.perf_counter() - began)
    tracemalloc.start()
    read()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return best, peak, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=500_000)
    parser.add_argument("--features", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "silo.csv"
        _write(path, args.rows, args.features)
        table = _Table("bench", path, "label", 2)

        def whole() -> Any:
            with path.open(newline="", encoding="utf-8-sig") as handle:
                return table._read_whole(handle)

        def cells() -> Any:
            with path.open(newline="", encoding="utf-8-sig") as handle:
                return table._parse(csv.reader(handle))

        size = path.stat().st_size
        fast_s, fast_peak, fast = _measure(whole, args.repeats)
        slow_s, slow_peak, slow = _measure(cells, args.repeats)
    assert fast is not None and fast[0] == slow[0]
    assert np.array_equal(fast[1], slow[1]) and np.array_equal(fast[2], slow[2])
    print(f"file: {size / 1e6:.1f} MB, {args.rows} rows x {args.features} features + label")
    print(f"numpy reader : {fast_s:6.2f} s, peak {fast_peak / 1e6:7.1f} MB")
    print(f"cell by cell : {slow_s:6.2f} s, peak {slow_peak / 1e6:7.1f} MB")
    print(f"ratios       : {slow_s / fast_s:.1f}x faster, {slow_peak / fast_peak:.1f}x less memory")


if __name__ == "__main__":
    main()
