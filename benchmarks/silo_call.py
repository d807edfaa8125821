"""What a call into a packed silo costs beyond the silo's own work: `SiloGroup.call` swaps the
process's random generators to the called silo's and back.

    python benchmarks/silo_call.py [--calls 3000]

Two heart-disease silos in one group, called alternately with a method that does nothing
(`attach` with no exporters); the median microseconds per call after a warm-up. A round makes
three such calls per silo (fit, evaluate, commit).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from paths import in_repo

from silo_pfl.config import to_dict
from silo_pfl.settings import load_config
from silo_pfl.silo_group import SiloGroup

SILOS = ("cleveland", "va")
WARM_UP = 500


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=3000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(in_repo("jobs/heart_disease.yaml"), [f"output_dir={tmp}"])
        group = SiloGroup(to_dict(cfg), SILOS)
        seconds = []
        for index in range(args.calls):
            began = time.perf_counter()
            group.call(SILOS[index % 2], "attach", {})
            seconds.append(time.perf_counter() - began)
    median = statistics.median(seconds[WARM_UP:]) * 1e6
    print(f"SiloGroup.call, two silos alternating, no-op method: median {median:.1f} us a call")


if __name__ == "__main__":
    main()
