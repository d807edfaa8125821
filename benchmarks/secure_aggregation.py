"""What secure aggregation (silo_pfl.secure: Bonawitz et al. with SecAgg+) costs.

    python benchmarks/secure_aggregation.py [JOB] [key=value ...]
        [--sections prg,cost,bytes,rounds,ray] [--pairs 3] [--values 1200000] [--repeats 3]

JOB and the overrides default to the issue's setting: jobs/digits_label_skew.yaml
model.name=mlp model.hidden=[2048,512] rounds=31 tracking.enabled=false (10 silos, FedPer, about
1.2M global values; 30 steady rounds a run, since with 5 a run's median moved by +-0.2 between
runs). Sections, in this order:

- prg: `silo_pfl.secure.prg.apply_stream` on one core, in GB/s of key stream (8 bytes a word),
  best of --repeats (target >= 3 GB/s), and `apply_streams` with the 10 keys of a silo's mask
  at 10 silos, against the raw AES-256-CTR and AES-256-GCM (the two engines that make the
  masks' words, `silo_pfl.secure.prg.engine` naming the one this process timed faster) and
  ChaCha20 of `cryptography` over the same bytes in one call, and a numpy uint64 add of the
  same vector;
- cost: one whole round of the protocol in this process, each step of each silo timed, for
  10, 25 and 50 silos, full mesh and SecAgg+ (k = ceil(log2 N) + 1), with no dropout and with
  one silo dropping after it shared its keys, on a vector of --values values; per step, the
  minimum over --repeats rounds of its mean per silo;
- bytes: what a silo sends for the protocol in a round (the advertisement, its sealed shares,
  its reveal), from the messages of a real round, against its masked vector (8 (values + 1)
  bytes);
- rounds: the job with aggregation.secure off and on, alternately, --pairs pairs in one Ray
  session; each run's median round (rounds 2..: round 1 pays the actors' start-up; its progress
  line adds the mean and the slowest) and the median of the pair ratios on / off (target <= 1.15).
  Then the key stream's floor, measured in the same run: the words every silo's mask adds (its
  self mask and one stream per peer) and the server's regenerated self masks, at the rate
  `apply_streams` makes them here with a silo's keys (best of --repeats, one core), spread over
  every core, added to the median plain round. No implementation of this protocol and encoding
  goes under that ratio on this machine; it leaves out everything else a secure round does
  (encoding, shares, unmasking's sum);
- ray: the job with rounds=4 for 10 and 25 silos, secure off, full mesh and SecAgg+, one run
  each; the median of rounds 2-4.

Each measurement starts once the shared machine is quiet (benchmarks/machine.py, bounded by
BENCH_QUIET_WAIT_S). The silos' identity keys of the Ray runs live in a temporary directory.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import ray
from common import RoundClock, job_parser, run_main, start_local_ray
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from machine import load_average, wait_for_quiet
from paths import in_repo

from silo_pfl.data import silo_names
from silo_pfl.federation import Federation
from silo_pfl.secure import identity, prg
from silo_pfl.secure.aggregator import SecureAggregator
from silo_pfl.secure.client import SecureClient
from silo_pfl.secure.fixed_point import encode
from silo_pfl.secure.messages import Advertisement, Pairing, Reveal, SealedShares
from silo_pfl.secure.params import SecureParams
from silo_pfl.secure.prg import apply_stream, apply_streams
from silo_pfl.secure.topology import default_threshold
from silo_pfl.settings import load_config

JOB = in_repo("jobs/digits_label_skew.yaml")
OVERRIDES = ["model.name=mlp", "model.hidden=[2048,512]", "rounds=31", "tracking.enabled=false"]
SECTIONS = ("prg", "cost", "bytes", "rounds", "ray")
COST_SILOS = (10, 25, 50)
RAY_SILOS = (10, 25)
RAY_ROUNDS = 4
PRG_WORDS = (1_200_000, 16_000_000)
STREAMS_KEYS = 10  # prg: the keys of one silo's mask at 10 silos (its seed and 9 peers)
WEIGHT = 100  # each silo's example count in the in-process rounds
T = TypeVar("T")


def secagg_plus_k(silos: int) -> int:
    """SecAgg+'s neighbours per silo: ceil(log2 N) + 1."""
    return math.ceil(math.log2(silos)) + 1


def best_seconds(repeats: int, work: Callable[[], object]) -> float:
    """The fastest of `repeats` timings of work()."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return min(times)


def prg_rates(words: int, repeats: int) -> dict[str, float]:
    """GB/s of key stream over `words` uint64 words: apply_stream, apply_streams with several
    keys (all their streams counted), the raw ciphers in one call, and numpy's add."""
    key, vector, other = os.urandom(32), np.ones(words, np.uint64), np.ones(words, np.uint64)
    zeros, out = bytes(8 * words), bytearray(8 * words + 15)

    def aes() -> None:
        Cipher(algorithms.AES(key), modes.CTR(bytes(16))).encryptor().update_into(zeros, out)

    def gcm() -> None:
        Cipher(algorithms.AES(key), modes.GCM(bytes(12))).encryptor().update_into(zeros, out)

    def chacha() -> None:
        Cipher(algorithms.ChaCha20(key, bytes(16)), None).encryptor().update_into(zeros, out)

    keys = [(os.urandom(32), 1 if i % 2 else -1) for i in range(STREAMS_KEYS)]
    works = {
        "apply_stream": lambda: apply_stream(vector, key, +1),
        f"apply_streams, {STREAMS_KEYS} keys": lambda: apply_streams(vector, keys),
        "AES-256-CTR, one call": aes,
        "AES-256-GCM, one call": gcm,
        "ChaCha20, one call": chacha,
        "numpy uint64 add": lambda: np.add(vector, other, out=vector),
    }
    rates = {}
    for name, work in works.items():
        wait_for_quiet()
        streams = STREAMS_KEYS if name.startswith("apply_streams") else 1
        rates[name] = streams * 8 * words / best_seconds(repeats, work) / 1e9
    return rates


def section_prg(repeats: int) -> None:
    """Mask generation in GB/s on one core."""
    columns = {words: prg_rates(words, repeats) for words in PRG_WORDS}
    print(
        f"\nGB/s of key stream on one core, best of {repeats}; the masks' engine here: "
        f"{prg.engine().upper()}; load average {load_average()}\n"
    )
    print("| | " + " | ".join(f"{w:,} words ({8 * w / 1e6:.1f} MB)" for w in PRG_WORDS) + " |")
    print("|---|" + "---|" * len(PRG_WORDS))
    for name in columns[PRG_WORDS[0]]:
        label = f"**{name}**" if name == "apply_stream" else name
        cells = " | ".join(f"{columns[w][name]:.2f}" for w in PRG_WORDS)
        print(f"| {label} | {cells} |")


def federation(
    count: int, neighbors: int | None
) -> tuple[dict[str, SecureClient], SecureAggregator]:
    """`count` silos with fresh identities, each trusting the others', and the server."""
    names = [f"s{i:02d}" for i in range(count)]
    params = SecureParams("bench", tuple(names), default_threshold(count), neighbors)
    keys = {name: Ed25519PrivateKey.generate() for name in names}
    trusted = {name: identity.public_bytes(key) for name, key in keys.items()}
    clients = {name: SecureClient(params, name, keys[name], trusted) for name in names}
    return clients, SecureAggregator(params, trusted)


@dataclass
class Round:
    """One in-process round: seconds per step (a list per silo step, one figure per server
    step), the messages each silo sent, and the masks each side drew."""

    silo: dict[str, list[float]]
    server: dict[str, float]
    adverts: list[Advertisement]
    bundles: list[SealedShares]
    reveals: list[Reveal]
    signatures: list[bytes]  # each survivor's confirmation of the unmask request
    pairings: list[Pairing]  # each survivor's signed peers, sent with its masked vector
    pairwise: list[int]  # per masking silo: its pairwise streams
    server_streams: tuple[int, int]  # the server's self-mask and pairwise streams


def timed(into: list[float], work: Callable[[], T]) -> T:
    """work(), its seconds appended to `into`."""
    start = time.perf_counter()
    result = work()
    into.append(time.perf_counter() - start)
    return result


def one_round(count: int, neighbors: int | None, values: int, drop: bool) -> Round:
    """A whole round of `count` silos on `values` values; with `drop`, the last silo stops after
    sharing its keys. Fails unless the unmasked sum is the survivors' encoded updates'."""
    clients, server = federation(count, neighbors)
    payload = {"x": np.random.default_rng(0).normal(0, 0.01, values).astype(np.float32)}
    steps = ("advertise", "share_keys", "mask", "confirm", "unmask")
    silo: dict[str, list[float]] = {s: [] for s in steps}
    spent: dict[str, list[float]] = {s: [] for s in ("enroll", "route", "check", "unmask")}
    adverts = [timed(silo["advertise"], lambda c=c: c.advertise(1, 1)) for c in clients.values()]
    timed(spent["enroll"], lambda: server.enroll(1, 1, adverts))
    bundles = [
        timed(silo["share_keys"], lambda c=c: c.share_keys(adverts)) for c in clients.values()
    ]
    inbox = timed(spent["route"], lambda: server.route(bundles))
    masking = list(clients)[:-1] if drop else list(clients)
    vectors = {
        n: timed(silo["mask"], lambda n=n: clients[n].mask(payload, WEIGHT, 1, 1, inbox[n]))
        for n in masking
    }
    for name in masking:
        timed(spent["check"], lambda name=name: server.check(name, 1, 1))
    paired = {n: clients[n].pairing(1, 1) for n in masking}
    request = timed(spent["check"], lambda: server.unmask_request(masking, paired))
    signed = [(n, timed(silo["confirm"], lambda n=n: clients[n].confirm(request))) for n in masking]
    request = dataclasses.replace(request, signatures=tuple(signed))
    reveals = [timed(silo["unmask"], lambda n=n: clients[n].unmask(request)) for n in masking]
    total = timed(spent["unmask"], lambda: server.unmask(vectors, reveals))
    expected = encode(payload, WEIGHT, count, "expected") * np.uint64(len(masking))
    if not np.array_equal(total, expected):
        raise RuntimeError(f"{count} silos: the unmasked sum is not the survivors' sum")
    plan = server.topology
    assert plan is not None
    gone = sum(len(plan.peers[d] & set(masking)) for d in request.dropped)
    return Round(
        silo,
        {step: sum(seconds) for step, seconds in spent.items()},
        adverts,
        bundles,
        reveals,
        [signature for _, signature in signed],
        list(paired.values()),
        [len(inbox[n]) for n in masking],
        (len(masking), gone),
    )


def cost_row(count: int, neighbors: int | None, values: int, drop: bool, repeats: int) -> str:
    """One table row: per step, the minimum over `repeats` rounds of its mean per silo (ms)."""
    rounds = []
    for _ in range(repeats):
        wait_for_quiet()
        rounds.append(one_round(count, neighbors, values, drop))
    silo = {s: min(statistics.mean(r.silo[s]) for r in rounds) for s in rounds[0].silo}
    server = {s: min(r.server[s] for r in rounds) for s in rounds[0].server}
    mode = "full mesh" if neighbors is None else "SecAgg+"
    k = count - 1 if neighbors is None else neighbors
    per_silo, at_server = sum(silo.values()), sum(server.values())
    own, pairwise = rounds[0].server_streams
    steps = " | ".join(f"{1000 * silo[s]:.2f}" for s in silo)
    return (
        f"| {count} | {mode} | {k} | {'1 after sharing' if drop else 'none'} | {steps} | "
        f"**{1000 * per_silo:.1f}** | {1000 * (server['enroll'] + server['route']):.1f} | "
        f"{1000 * server['unmask']:.1f} | **{1000 * at_server:.1f}** | "
        f"{statistics.mean(rounds[0].pairwise):.1f} | {own} + {pairwise} |"
    )


def section_cost(values: int, repeats: int) -> None:
    """Cost per silo and at the server of the masking alone, in one process."""
    rows = [
        cost_row(count, neighbors, values, drop, repeats)
        for count in COST_SILOS
        for neighbors in (None, secagg_plus_k(count))
        for drop in (False, True)
    ]
    print(
        f"\nms, one round in one process on {values:,} values (minimum over {repeats} rounds of "
        f"each step's mean per silo); load average {load_average()}\n"
    )
    print(
        "| N | mode | k | dropout | advertise | share_keys | mask | confirm | unmask | per silo | "
        "server enroll + route | server unmask | server (all steps) | pairwise streams per "
        "silo | server streams (self + pairwise) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


def bytes_row(count: int, neighbors: int | None, values: int) -> str:
    """One table row: the mean bytes a silo sends for the protocol in one round."""
    sent = one_round(count, neighbors, 1, drop=False)
    advert = statistics.mean(len(a.cipher_key + a.mask_key + a.signature) for a in sent.adverts)
    sealed = statistics.mean(sum(map(len, b.sealed.values())) for b in sent.bundles)
    reveal = statistics.mean(
        sum(map(len, [*r.seeds.values(), *r.mask_keys.values()])) for r in sent.reveals
    )
    confirm = statistics.mean(len(signature) for signature in sent.signatures) + statistics.mean(
        len(p.signature) + len(",".join(p.peers)) for p in sent.pairings
    )
    vector = 8 * (values + 1)
    total = advert + sealed + confirm + reveal
    mode = "full mesh" if neighbors is None else "SecAgg+"
    k = count - 1 if neighbors is None else neighbors
    return (
        f"| {count} | {mode} | {k} | {advert:,.0f} | {sealed:,.0f} | {confirm:,.0f} | "
        f"{reveal:,.0f} | "
        f"**{total:,.0f}** | {vector:,} | {100 * total / vector:.3f}% |"
    )


def section_bytes(values: int) -> None:
    """Extra bytes each silo sends per round for the protocol, against its masked vector."""
    rows = [
        bytes_row(count, neighbors, values)
        for count in COST_SILOS
        for neighbors in (None, secagg_plus_k(count))
    ]
    print(
        f"\nbytes one silo sends per round (mean over silos), masked vector of {values:,} values\n"
    )
    print(
        "| N | mode | k | advertisement | sealed shares | pairing + confirmation | reveal | "
        "protocol total "
        "| masked vector | protocol / vector |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


def ray_run(job: str, overrides: Sequence[str], keys: str) -> tuple[list[float], int]:
    """One run on the session's Ray: the seconds of its rounds 2.. (round 1 pays the actors'
    start-up), and its global parameters. Each silo's identity key lives under `keys`."""
    cfg = load_config(job, list(overrides))
    homes = [f"silos.{name}.key_dir={keys}/{name}" for name in silo_names(cfg.data)]
    clock = RoundClock()
    with tempfile.TemporaryDirectory() as tmp:
        wait_for_quiet()
        cfg = load_config(job, [*overrides, *homes, f"output_dir={tmp}"])
        result = Federation(cfg, callbacks=[clock]).run()
    return clock.round_seconds()[1:], result.global_parameters


def keystream_floor(
    job: str, overrides: Sequence[str], values: int, repeats: int
) -> tuple[int, int, float, float]:
    """The secure round's key stream on this machine: the silos, each silo's peers, the bytes
    of key stream a round makes (every silo's mask and the server's self masks, one vector of
    `values` + 1 words each) and the seconds it takes spread over every core, at the rate
    `apply_streams` reaches here with one silo's keys."""
    cfg = load_config(job, [*overrides, "aggregation.secure=true"])
    silos = len(silo_names(cfg.data))
    peers = cfg.aggregation.secure_graph.neighbors or silos - 1
    vector = np.zeros(values + 1, np.uint64)
    keys = [(os.urandom(32), 1 if i % 2 else -1) for i in range(1 + peers)]
    wait_for_quiet()
    rate = len(keys) * vector.nbytes / best_seconds(repeats, lambda: apply_streams(vector, keys))
    stream_bytes = vector.nbytes * silos * (len(keys) + 1)
    return silos, peers, stream_bytes, stream_bytes / rate / (os.cpu_count() or 1)


def section_rounds(job: str, overrides: Sequence[str], pairs: int, keys: str, repeats: int) -> None:
    """Round time with secure off and on, alternately in one Ray session, and the floor the
    key stream sets."""
    lines, ratios, size, plain = [], [], 0, []
    for pair in range(pairs):
        seconds = {}
        for secure in (False, True) if pair % 2 == 0 else (True, False):
            flag = f"aggregation.secure={str(secure).lower()}"
            rounds, size = ray_run(job, [*overrides, flag], keys)
            seconds[secure] = statistics.median(rounds)
            print(
                f"  pair {pair + 1} secure {secure}: median {1000 * seconds[secure]:.0f} ms, "
                f"mean {1000 * statistics.mean(rounds):.0f}, slowest {1000 * max(rounds):.0f} "
                f"({len(rounds)} rounds)",
                flush=True,
            )
        ratios.append(seconds[True] / seconds[False])
        plain.append(seconds[False])
        order = "off, on" if pair % 2 == 0 else "on, off"
        lines.append(
            f"| {pair + 1} ({order}) | {1000 * seconds[False]:.0f} | {1000 * seconds[True]:.0f} "
            f"| {ratios[-1]:.2f} |"
        )
    print(
        f"\n{job} {' '.join(overrides)}: {size:,} global values; ms per round, median of rounds "
        f"2.. of each run; load average {load_average()}\n"
    )
    print("| pair | secure off | secure on | on / off |\n|---|---|---|---|")
    print("\n".join(lines))
    print(f"| median of the pair ratios | | | **{statistics.median(ratios):.2f}** |")
    silos, peers, stream_bytes, floor = keystream_floor(job, overrides, size, repeats)
    off = statistics.median(plain)
    print(
        f"\nThe key stream's floor: {silos} silos x (1 + {peers} peers) streams and the server's "
        f"{silos} self masks, {stream_bytes / 1e6:.0f} MB a round; at this machine's rate over "
        f"{os.cpu_count()} cores {1000 * floor:.0f} ms, against the median plain round of "
        f"{1000 * off:.0f} ms: no secure round here goes under **{(off + floor) / off:.2f}x**."
    )


def section_ray(job: str, overrides: Sequence[str], keys: str) -> None:
    """Round time on Ray for 10 and 25 silos: secure off, full mesh and SecAgg+."""
    lines = []
    for count in RAY_SILOS:
        k = secagg_plus_k(count)
        modes = [
            ("off", count - 1, ["aggregation.secure=false"]),
            ("full mesh", count - 1, ["aggregation.secure=true"]),
            ("SecAgg+", k, ["aggregation.secure=true", f"aggregation.secure_graph.neighbors={k}"]),
        ]
        base = [*overrides, f"rounds={RAY_ROUNDS}", f"data.num_silos={count}"]
        times = {}
        for mode, peers, flags in modes:
            seconds = times[mode] = statistics.median(ray_run(job, [*base, *flags], keys)[0])
            print(f"  {count} silos, {mode}: {1000 * seconds:.0f} ms", flush=True)
            shown = "" if mode == "off" else str(peers)
            ratio = seconds / times["off"]
            lines.append(f"| {count} | {mode} | {shown} | **{1000 * seconds:.0f}** | {ratio:.2f} |")
    print(
        f"\n{job} {' '.join(overrides)} rounds={RAY_ROUNDS}: ms per round, median of rounds "
        f"2-{RAY_ROUNDS}, one run each; load average {load_average()}\n"
    )
    print("| silos | secure | k | ms per round | / secure off |\n|---|---|---|---|---|")
    print("\n".join(lines))


def main() -> None:
    parser = job_parser(__doc__, JOB)
    parser.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated")
    parser.add_argument("--pairs", type=int, default=3, help="rounds: off/on pairs")
    parser.add_argument("--values", type=int, default=1_200_000, help="cost, bytes: vector size")
    parser.add_argument("--repeats", type=int, default=3, help="prg, cost, floor: best of")
    args = parser.parse_args()
    sections = args.sections.split(",")
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        parser.error(f"--sections: unknown {', '.join(sorted(unknown))}; from {SECTIONS}")
    overrides = args.overrides or OVERRIDES
    if "prg" in sections:
        section_prg(args.repeats)
    if "cost" in sections:
        section_cost(args.values, args.repeats)
    if "bytes" in sections:
        section_bytes(args.values)
    if "rounds" in sections or "ray" in sections:
        start_local_ray()
        with tempfile.TemporaryDirectory() as keys:
            if "rounds" in sections:
                section_rounds(args.job, overrides, args.pairs, keys, args.repeats)
            if "ray" in sections:
                section_ray(args.job, overrides, keys)
        ray.shutdown()


if __name__ == "__main__":
    run_main(main)
