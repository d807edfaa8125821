"""resnet18 across 10 silos: what a round costs beyond training, against moving the same bytes
once through Ray's object store; and the server's aggregation against a plain numpy sum.

    python benchmarks/large_model.py [JOB] [key=value ...] [--rounds 4]

JOB defaults to jobs/digits_label_skew.yaml, run as fedavg (every key global) on resnet18 (11.2M
parameters, 44.7 MB) over 32x32 RGB inputs (data.image_shape=[3,32,32]: the 8x8 digits, each
pixel repeated 4x4 times, the grey in 3 channels), one local step per round
(data.max_train_rows = train.batch_size = 16), 10 silos in 2 workers (ray.silos_per_worker=5),
evaluated on few rows (data.val_fraction = data.test_fraction = 0.03: about 5 rows each) so that
evaluating, compute like training, weighs little, and every silo keeping every round's model
(eval.selection=last). Overrides on the command line apply after these.

The federation's rounds 2.. (round 1 pays start-up) are the repetitions; each figure is the min:
- round: the driver's wall time from the round before's end to its own (fits, aggregation,
  evaluations, commits, the server's checkpoint; a round's fits start with the commits of the
  round before).
- training on the critical path: a worker runs its silos one after another, so the max over
  workers of the sum of its silos' FitMetrics.train_seconds. That is a silo's whole fit call
  (rollback, loading the global keys, the local step, the divergence check, the delta): what
  fit copies counts as training here.
- outside training: round - training, per round; with eval.every=k > 1, the least of the rounds
  that evaluate and that of the rounds between, in two rows (eval.every=2 --rounds 9: four of
  each).
- object store move: ray.put in the driver of the bytes a round moves (the global state once,
  the server's aggregate's answer, which the evaluations and the next fits share, and each
  silo's delta) as that many states of the model, then ray.get of them in another worker
  process; the fastest of MOVE_REPEATS (8).
Timed apart on plain Silos and a plain Server of the same config, in this process with the same
Ray, min of 3, summed per worker and the slowest worker taken where silos do it (a round reports
none of them per call):
- evaluation, commits, the server's checkpoint: their share of the time outside training (a
  worker's silos here run without the other worker's disk writes beside them; a worker's
  commits are its silos' `evaluate_and_commit` calls in one durable block, as on Ray, less
  their `evaluate` calls: writing each round's model and checkpoint, and one sync);
- the data path: the server's put of the global state; per silo, getting it from the store and
  loading it (once: a fit after the evaluation of the same state does not load it again),
  making its delta and putting its update; the server getting the updates and aggregating them.
Aggregation, on 10 updates of resnet18's shapes, in GB/s of updates read: Server.aggregate
(checks, weighted mean, the server optimizer's step) and aggregation.weighted_mean, against
numpy's in-place sum of the same arrays (float32: `acc += d`) and that sum into a float64
accumulator.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import ray
from common import RoundClock, job_parser, run_main, start_local_ray

from silo_pfl import durable
from silo_pfl.aggregation import State, weighted_mean
from silo_pfl.config import FederationConfig, to_dict
from silo_pfl.data import load_silo_data, silo_names
from silo_pfl.federation import Federation
from silo_pfl.messages import SiloUpdate
from silo_pfl.runtime.packing import pack
from silo_pfl.server_start import new_server
from silo_pfl.settings import load_config
from silo_pfl.silo import Silo

DEFAULTS = (
    "algorithm.name=fedavg",
    "model.name=resnet18",
    "data.image_shape=[3,32,32]",
    "data.max_train_rows=16",
    "train.batch_size=16",
    "train.local_epochs=1",
    "ray.silos_per_worker=5",
    "data.val_fraction=0.03",
    "data.test_fraction=0.03",
    "eval.selection=last",
    "tracking.enabled=false",
)
REPEATS = 3
MOVE_REPEATS = 8


def best_of(work: Callable[[], object]) -> float:
    """The fastest of REPEATS timings of work(), in seconds."""
    return best_of_each(lambda: None, lambda _: work())


def best_of_each(prepare: Callable[[], Any], work: Callable[[Any], object]) -> float:
    """The fastest of REPEATS timings of work(prepare()), prepare() untimed."""
    times = []
    for _ in range(REPEATS):
        given = prepare()
        start = time.perf_counter()
        work(given)
        times.append(time.perf_counter() - start)
    return min(times)


def critical(groups: Sequence[Sequence[str]], seconds: dict[str, float]) -> float:
    """The slowest worker's sum over its silos, which it runs one after another."""
    return max(sum(seconds[name] for name in group) for group in groups)


@ray.remote
def _received(states: list[State]) -> int:
    """Runs in another worker: the states arrive by ray.get from the object store."""
    return sum(v.nbytes for state in states for v in state.values())


def object_store_move(states: list[State]) -> float:
    """Seconds to ray.put `states` in the driver and ray.get them in another worker, the fastest
    of MOVE_REPEATS: a put into store memory not touched lately runs at a third of the speed of
    one into memory touched already (page faults), and which one a put gets varies."""
    ray.get(_received.remote(ray.put(states[:1])))  # the worker process is started
    times = []
    for _ in range(MOVE_REPEATS):
        start = time.perf_counter()
        ray.get(_received.remote(ray.put(states)))
        times.append(time.perf_counter() - start)
    return min(times)


def federation(
    cfg: FederationConfig, groups: list[list[str]]
) -> tuple[list[float], list[float], list[bool]]:
    """Per round after the first: its seconds, its training on the critical path, and whether
    it was evaluated (eval.every)."""
    clock = RoundClock()
    result = Federation(cfg, callbacks=[clock]).run()
    seconds = clock.round_seconds()
    rounds, training, evaluated = [], [], []
    for summary in result.history[1:]:
        rounds.append(seconds[summary.round - 1])
        fits = {name: figures["train_seconds"] for name, figures in summary.silos.items()}
        training.append(critical(groups, fits))
        evaluated.append(summary.evaluated)
    return rounds, training, evaluated


def outside_rows(
    rounds: list[float], training: list[float], evaluated: list[bool]
) -> list[tuple[str, float]]:
    """The least time outside training of a round: one row, or, when some rounds were not
    evaluated (eval.every), one for the rounds that evaluate and one for the rounds between."""
    outside = [r - t for r, t in zip(rounds, training, strict=True)]
    if all(evaluated):
        return [("outside training", min(outside))]
    pairs = list(zip(outside, evaluated, strict=True))
    kinds = [("a round that evaluates", True), ("a round between evaluations", False)]
    return [
        (f"outside training, {label}", min(o for o, e in pairs if e == kind))
        for label, kind in kinds
        if kind in evaluated
    ]


def model_inputs(cfg: FederationConfig) -> tuple[tuple[int, ...], int]:
    """The input shape and classes of the job's model, from its first silo's data."""
    data = load_silo_data(cfg.data, silo_names(cfg.data)[0], cfg.seed)
    return data.input_shape, data.num_classes


def plain_silos(cfg: FederationConfig, groups: list[list[str]]) -> dict[str, float]:
    """On the slowest worker: its silos' evaluations, commits and share of the data path. A
    worker's commits are timed as it makes them: its silos' evaluations and commits one after
    another in one durable block (durable.durable_together), less their evaluations."""
    config = to_dict(cfg)
    start = ray.put(new_server(config, *model_inputs(cfg)).global_state())
    data: dict[str, float] = {}
    silos: dict[str, Silo] = {}
    for name in silo_names(cfg.data):
        silo = silos[name] = Silo(config, name)
        info = silo.setup()
        silo.build(info.input_shape, info.num_classes)

        def move(silo: Silo = silo, name: str = name) -> None:
            reference = silo._load_global(ray.get(start))
            state = silo.model.state_dict()
            delta = {k: (state[k] - reference[k]).numpy() for k in silo.split.global_keys}
            ray.put(SiloUpdate(name, 1, 16, delta))

        data[name] = best_of(move)
    evaluate, both = [], []
    for round_ in range(1, 2 * REPEATS + 1, 2):
        evaluate.append([])
        both.append([])
        for group in groups:
            began = time.perf_counter()
            for name in group:
                silos[name].evaluate(ray.get(start), round_)
            evaluate[-1].append(time.perf_counter() - began)
            began = time.perf_counter()
            with durable.durable_together():
                for name in group:
                    silos[name].evaluate_and_commit(ray.get(start), round_ + 1, round_ - 1 or None)
            both[-1].append(time.perf_counter() - began)
    per_group = range(len(groups))
    evaluations = [min(times[g] for times in evaluate) for g in per_group]
    commits = [max(0.0, min(times[g] for times in both) - evaluations[g]) for g in per_group]
    return {"evaluate": max(evaluations), "commit": max(commits), "data": critical(groups, data)}


def random_updates(state: State, silos: int) -> list[State]:
    """`silos` deltas of the state's keys, shapes and dtypes (small random values)."""
    rng = np.random.default_rng(0)
    return [
        {
            key: (rng.random(value.shape, dtype=np.float32) - 0.5) * np.float32(1e-3)
            if np.issubdtype(value.dtype, np.floating)
            else np.ones(value.shape, value.dtype)
            for key, value in state.items()
        }
        for _ in range(silos)
    ]


def numpy_sum(deltas: list[State], dtype: type | None) -> State:
    """The plain sum of the arrays per key, in place into a copy of the first (dtype None: the
    arrays' own) or into a float64 accumulator."""
    total: State = {}
    for key in deltas[0]:
        acc = np.array(deltas[0][key], dtype=dtype)
        for delta in deltas[1:]:
            acc += delta[key]
        total[key] = acc
    return total


def plain_server(cfg: FederationConfig) -> dict[str, float]:
    """The server here: its aggregate, the weighted mean and the plain numpy sums in GB/s of
    updates read; in seconds, its checkpoint of a round, its put of the global state and
    getting the updates from the store and aggregating them."""
    config = to_dict(cfg)
    server = new_server(config, *model_inputs(cfg))
    names = silo_names(cfg.data)
    deltas = random_updates(server.global_state(), len(names))
    weights = [16 + i for i in range(len(names))]
    size = sum(v.nbytes for delta in deltas for v in delta.values())

    def updates() -> list[SiloUpdate]:
        round_ = server.round + 1
        return [SiloUpdate(n, round_, w, d) for n, w, d in zip(names, weights, deltas, strict=True)]

    seconds = {
        "server": best_of_each(updates, lambda given: server.aggregate(*given)),
        "weighted_mean": best_of(lambda: weighted_mean(deltas, weights)),
        "numpy_sum": best_of(lambda: numpy_sum(deltas, None)),
        "numpy_sum64": best_of(lambda: numpy_sum(deltas, np.float64)),
    }
    figures = {name: size / s / 1e9 for name, s in seconds.items()}
    stored = best_of_each(
        lambda: [ray.put(u) for u in updates()], lambda refs: server.aggregate(*ray.get(refs))
    )
    return figures | {
        "bytes": float(size),
        "checkpoint": best_of(lambda: server.checkpoint(server.round, {})),
        "data": best_of(lambda: ray.put(server.global_state())) + stored,
    }


def main() -> None:
    parser = job_parser(__doc__, "jobs/digits_label_skew.yaml")
    parser.add_argument("--rounds", type=int, default=REPEATS + 1)
    args = parser.parse_args()
    start_local_ray()
    with tempfile.TemporaryDirectory() as tmp:
        overrides = [*DEFAULTS, *args.overrides, f"rounds={args.rounds}"]
        cfg = load_config(args.job, [*overrides, f"output_dir={tmp}/ray"])
        names = silo_names(cfg.data)
        groups = pack(cfg, names, ray.cluster_resources().get("CPU", 1))
        rounds, training, evaluated = federation(cfg, groups)
        start = new_server(to_dict(cfg), *model_inputs(cfg)).global_state()
        states = [{k: v.copy() for k, v in start.items()} for _ in range(len(names) + 1)]
        moved = sum(v.nbytes for state in states for v in state.values())
        move = object_store_move(states)
        del states
        plain = load_config(args.job, [*overrides, f"output_dir={tmp}/plain"])
        silos = plain_silos(plain, groups)
        server = plain_server(plain)
    data = silos["data"] + server["data"]
    print(
        f"{args.job} {' '.join(overrides)}: {len(names)} silos in {len(groups)} workers, "
        f"rounds 2..{args.rounds}, min of {len(rounds)}; {moved / 1e6:.0f} MB moved per round"
    )
    print("\n| per round | seconds | against | ratio | target |\n|---|---|---|---|---|")
    print(f"| round | {min(rounds):.3f} | | | |")
    print(f"| training on the critical path | {min(training):.3f} | | | |")
    against = f"object store move {move:.3f}"
    for label, outside in outside_rows(rounds, training, evaluated):
        print(f"| {label} | {outside:.3f} | {against} | {outside / move:.2f}x | <= 1.5x |")
    for label, value in (
        ("evaluation", silos["evaluate"]),
        ("commits", silos["commit"]),
        ("server checkpoint", server["checkpoint"]),
    ):
        print(f"| - {label} (timed apart) | {value:.3f} | | | |")
    print(f"| - the data path (timed apart) | {data:.3f} | {against} | {data / move:.2f}x | |")
    size = server["bytes"] / 1e6 / len(names)
    print(f"| **aggregation, {len(names)} updates of {size:.1f} MB** | GB/s | | | |")
    reference = server["numpy_sum"]
    for label, key in (
        ("Server.aggregate (checks, mean, step)", "server"),
        ("aggregation.weighted_mean", "weighted_mean"),
        ("numpy sum into float64 (`acc64 += d`)", "numpy_sum64"),
    ):
        target = ">= 0.5x" if key == "server" else ""
        print(
            f"| {label} | {server[key]:.2f} | numpy sum {reference:.2f} | "
            f"{server[key] / reference:.2f}x | {target} |"
        )


if __name__ == "__main__":
    run_main(main)
