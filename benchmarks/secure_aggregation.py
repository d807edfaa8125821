"""Cost of secure aggregation per round, as ratios measured in one Ray session.

    python benchmarks/secure_aggregation.py [JOB] [--pairs 3] [key=value ...]

JOB defaults to jobs/digits_label_skew.yaml.

Runs the job with aggregation.secure off and on, alternately, and compares the median round time
(rounds 2 onwards: round 1 pays the actors' start-up). Then, in this process, times the masking
work alone for one silo (encode, plus a ChaCha20 stream per peer) and the server's unmasking,
against the plain weighted mean, on vectors of the job's global size.
"""

from __future__ import annotations

import statistics
import tempfile
import time

import numpy as np
import ray
from common import job_parser, start_local_ray

from silo_pfl.aggregation import weighted_mean
from silo_pfl.data import load_silo_data, silo_names
from silo_pfl.federation import Federation
from silo_pfl.secure_aggregation import Masker, decode_mean, masked_sum
from silo_pfl.settings import load_config, split_rules
from silo_pfl.silo import init_model
from silo_pfl.split import compute_split


def median_round_seconds(job: str, overrides: list[str], secure: bool, tmp: str) -> float:
    """Median seconds of rounds 2.. of one run."""
    cfg = load_config(
        job,
        [
            *overrides,
            "tracking.enabled=false",
            f"aggregation.secure={str(secure).lower()}",
            f"output_dir={tmp}",
        ],
    )
    result = Federation(cfg).run()
    return statistics.median(r.seconds for r in result.history[1:])


def best_of(repeats: int, work) -> float:
    """The fastest of `repeats` timings of work(), in seconds."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return min(times)


def masking_alone(num_silos: int, shapes: dict[str, tuple[int, ...]]) -> None:
    """In-process timings of one silo's masking and the server's unmasking."""
    names = [f"silo_{i}" for i in range(num_silos)]
    maskers = {name: Masker("bench", name) for name in names}
    keys = {name: m.public_key() for name, m in maskers.items()}
    for masker in maskers.values():
        masker.pair_with(keys)
    rng = np.random.default_rng(0)
    payloads = [
        {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()} for _ in names
    ]
    vectors = [maskers[n].mask(p, 100, 1) for n, p in zip(names, payloads, strict=True)]
    mask = best_of(5, lambda: maskers[names[0]].mask(payloads[0], 100, 1))
    unmask = best_of(5, lambda: decode_mean(masked_sum(vectors), shapes))
    plain = best_of(5, lambda: weighted_mean(payloads, [100] * num_silos))
    size = sum(int(np.prod(s)) for s in shapes.values())
    print(f"\n{size} global values, {num_silos} silos (each masks against {num_silos - 1} peers)")
    print(f"one silo's masking: {1000 * mask:.2f} ms")
    print(
        f"server: unmask the sum {1000 * unmask:.2f} ms, plain weighted mean {1000 * plain:.2f} ms"
    )


def main() -> None:
    parser = job_parser(__doc__, "jobs/digits_label_skew.yaml")
    parser.add_argument("--pairs", type=int, default=3)
    args = parser.parse_args()
    start_local_ray()
    rounds: dict[bool, list[float]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp:
        for pair in range(args.pairs):
            for secure in (False, True) if pair % 2 == 0 else (True, False):
                rounds[secure].append(median_round_seconds(args.job, args.overrides, secure, tmp))
                state = "on " if secure else "off"
                print(f"pair {pair + 1} secure {state}: {1000 * rounds[secure][-1]:.0f} ms/round")
    ray.shutdown()
    on, off = statistics.median(rounds[True]), statistics.median(rounds[False])
    print(
        f"median round: secure {1000 * on:.0f} ms, plain {1000 * off:.0f} ms, ratio {on / off:.2f}"
    )

    cfg = load_config(args.job, args.overrides)
    names = silo_names(cfg.data)
    data = load_silo_data(cfg.data, names[0], cfg.seed)
    model = init_model(cfg, data.input_shape, data.num_classes)
    state = model.state_dict()
    split = compute_split(model, split_rules(cfg))
    masking_alone(len(names), {k: tuple(state[k].shape) for k in split.global_keys})


if __name__ == "__main__":
    main()
