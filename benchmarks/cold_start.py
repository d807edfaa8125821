"""The first training step in a fresh process: torch.optim against silo_pfl.optim.

    python benchmarks/cold_start.py [--repeats 3]

Each measurement is a new Python process (as a new silo actor is) that imports torch, builds
cnn_small and times its first optimizer construction and step. torch.optim's first use imports
torch._dynamo; silo_pfl.optim does the same arithmetic without it.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

PROBE = """
import time, torch
from silo_pfl.models import build_model
from silo_pfl.optim import SGD
model = build_model("cnn_small", (1, 8, 8), 10)
x, y = torch.randn(32, 1, 8, 8), torch.randint(0, 10, (32,))
began = time.perf_counter()
opt = {factory}(model.parameters(), lr=0.05, momentum=0.9)
opt.zero_grad()
torch.nn.functional.cross_entropy(model(x), y).backward()
opt.step()
print(time.perf_counter() - began)
"""


def first_step(factory: str) -> float:
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(factory=factory)],
        capture_output=True,
        text=True,
        check=True,
    )
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    times: dict[str, list[float]] = {"torch.optim.SGD": [], "SGD": []}
    for _ in range(args.repeats):
        for factory in times:
            times[factory].append(first_step(factory))
    theirs, ours = (statistics.median(times[k]) for k in ("torch.optim.SGD", "SGD"))
    print(f"first step in a fresh process, median of {args.repeats} (alternated):")
    print(f"  torch.optim.SGD     {theirs * 1000:8.1f} ms")
    print(f"  silo_pfl.optim.SGD  {ours * 1000:8.1f} ms")
    print(f"  ratio {theirs / ours:.1f}x")


if __name__ == "__main__":
    main()
