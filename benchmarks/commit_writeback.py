"""A worker's commit of its silos, keeping their models: the files taken to the disk as each is
written (durable.WRITEBACK_BYTES, sync_file_range) against all of them at the block's end.

    python benchmarks/commit_writeback.py [--silos 5] [--repeats 10]

For the wide body (`model.name=mlp model.hidden=[1024,1024]`, 4.3 MB a model) and resnet18 on
32x32 inputs (44.7 MB), as `benchmarks/rounds.py` and `benchmarks/large_model.py` run them: the
silos of one worker (their first `--silos`) evaluate a round, then commit it keeping their model
in one `durable_together` block, as `SiloHost.many` calls them. Only the commits' block is timed.
Repetitions alternate between the two ways in this process; prints the median and minimum ms a
block and the ratio of the medians.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from common import in_process_federation, run_main
from paths import in_repo

from silo_pfl import durable
from silo_pfl.settings import load_config

JOB = in_repo("jobs/digits_label_skew.yaml")
BASE = ["algorithm.name=fedavg", "tracking.enabled=false"]
MODELS = {
    "wide body, 4.3 MB": ["model.name=mlp", "model.hidden=[1024,1024]"],
    "resnet18, 44.7 MB": [
        "model.name=resnet18",
        "data.image_shape=[3,32,32]",
        "data.val_fraction=0.03",
        "data.test_fraction=0.03",
    ],
}
NEVER = 1 << 62  # a threshold no file reaches: every file waits for the block's end


def timed_blocks(overrides: list[str], silos: int, repeats: int) -> dict[bool, list[float]]:
    """Seconds of each commit block, by whether files start to the disk as they are written."""
    early = durable.WRITEBACK_BYTES
    seconds: dict[bool, list[float]] = {True: [], False: []}
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        cfg = load_config(JOB, [*BASE, *overrides, f"output_dir={tmp}"])
        worker, server = in_process_federation(cfg)
        worker = worker[:silos]
        state = server.global_state()
        try:
            for round_ in range(1, 2 * repeats + 2):
                for silo in worker:
                    silo.evaluate(state, round_)
                way = round_ % 2 == 0
                durable.WRITEBACK_BYTES = early if way else NEVER
                began = time.perf_counter()
                with durable.durable_together():
                    for silo in worker:
                        silo.commit(round_, keep=True)
                if round_ > 1:  # the first block creates the files that later ones recycle
                    seconds[way].append(time.perf_counter() - began)
        finally:
            durable.WRITEBACK_BYTES = early
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--silos", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    print(f"{args.silos} silos' commits keeping their models, one block; ms, {args.repeats} each")
    print("| model | at the block's end: median (min) | as written: median (min) | ratio |")
    print("|---|---|---|---|")
    for label, overrides in MODELS.items():
        seconds = timed_blocks(overrides, args.silos, args.repeats)
        late, early = statistics.median(seconds[False]), statistics.median(seconds[True])
        print(
            f"| {label} | {1000 * late:.1f} ({1000 * min(seconds[False]):.1f}) "
            f"| {1000 * early:.1f} ({1000 * min(seconds[True]):.1f}) | {early / late:.2f} |"
        )


if __name__ == "__main__":
    run_main(main)
