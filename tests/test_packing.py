"""Several silos in one worker process (`ray.silos_per_worker`): who shares a worker, and that a
packed silo computes bit for bit what it computes alone, without Ray and on a real local Ray."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from silo_pfl import checkpoint
from silo_pfl.config import to_dict
from silo_pfl.errors import ConfigError
from silo_pfl.federation import Federation
from silo_pfl.runtime.packing import pack
from silo_pfl.server_start import new_server
from silo_pfl.silo_group import SiloGroup
from silo_pfl.silo_store import CHECKPOINTS, GLOBAL_PART, SELECTED

SILOS = ("cleveland", "hungarian")
HOSPITALS = ("cleveland", "hungarian", "switzerland", "va")


def test_auto_packs_one_worker_per_cpu_and_per_node_one_silo_each(job):
    names = [f"silo_{i}" for i in range(10)]
    cfg = job("jobs/digits_label_skew.yaml")
    assert cfg.ray.silos_per_worker == "auto"
    groups = pack(cfg, names, cpus=2)
    assert [len(g) for g in groups] == [5, 5]
    assert sorted(n for g in groups for n in g) == sorted(names)
    assert [len(g) for g in pack(cfg, names, cpus=16)] == [1] * 10
    three = job("jobs/digits_label_skew.yaml", "ray.silos_per_worker=3")
    assert [len(g) for g in pack(three, names, cpus=2)] == [3, 3, 2, 2]
    per_node = job("jobs/digits_label_skew.yaml", "ray.placement=per_node")
    assert pack(per_node, names, cpus=2) == [[n] for n in names]


def test_per_node_gives_each_silo_its_own_worker_whatever_silos_per_worker_says(job):
    """Two silos on one labelled node packed under `any`; under per_node, and a k for packing,
    still one actor per silo."""
    shared = ["silos.cleveland.node_label.site=a", "silos.hungarian.node_label.site=a"]
    packed = job("jobs/heart_disease.yaml", "ray.silos_per_worker=3", *shared)
    assert ["cleveland", "hungarian"] in pack(packed, list(HOSPITALS), cpus=2)
    per_node = job("jobs/heart_disease.yaml", "ray.placement=per_node", "ray.silos_per_worker=3")
    assert pack(per_node, list(HOSPITALS), cpus=2) == [[n] for n in HOSPITALS]
    # Under per_node two silos may not share a node's labels (settings refuses them at load);
    # a silo pinned by labels of its own still gets a worker of its own.
    pinned = job(
        "jobs/heart_disease.yaml",
        "ray.placement=per_node",
        "ray.silos_per_worker=3",
        "silos.cleveland.node_label.site=a",
    )
    assert pack(pinned, list(HOSPITALS), cpus=2) == [[n] for n in HOSPITALS]


def test_a_silo_pinned_to_a_node_gets_its_own_worker_under_auto(job):
    cfg = job("jobs/heart_disease.yaml", "silos.cleveland.node_label.site=a")
    groups = pack(cfg, ["cleveland", "hungarian", "switzerland", "va"], cpus=1)
    assert ["cleveland"] in groups
    assert sorted(len(g) for g in groups) == [1, 3]


@pytest.mark.parametrize("value", ["0", "-2", "many", "1.5", "true"])
def test_a_bad_silos_per_worker_is_one_line_naming_the_key(job, value):
    with pytest.raises(ConfigError) as info:
        job("jobs/digits_label_skew.yaml", f"ray.silos_per_worker={value}")
    message = str(info.value)
    assert message.startswith("ray.silos_per_worker:") and "an integer >= 1, or auto" in message
    assert "\n" not in message


def _rounds(groups: list[SiloGroup], config: dict, rounds: int, order: tuple) -> dict[str, list]:
    """Plain rounds over silos spread on `groups`, each step called silo by silo in `order`;
    each silo's updates and evaluations."""
    where = {name: group for group in groups for name in group.silos}
    infos = [where[n].call(n, "setup") for n in order]
    for name in order:
        where[name].call(name, "build", infos[0].input_shape, infos[0].num_classes)
    server = new_server(config, infos[0].input_shape, infos[0].num_classes)
    seen: dict[str, list] = {name: [] for name in order}
    for round_ in range(1, rounds + 1):
        state = server.global_state()
        updates = {n: where[n].call(n, "fit", state, round_)[0] for n in order}
        assert server.aggregate(*[updates[n] for n in SILOS]).aggregated
        for name in order:
            seen[name].append(updates[name].delta)
            seen[name].append(where[name].call(name, "evaluate", server.global_state(), round_))
            where[name].call(name, "commit", round_, True)
    return seen


def test_packed_silos_draw_from_their_own_generators_bit_for_bit(job, tmp_path):
    """With an algorithm that draws from torch's global generator every batch, two silos in one
    process compute exactly what each computes in a group of its own, whichever goes first (in
    one process, a shared stream would give the silo that draws second other numbers)."""
    overrides = ("algorithm.name=global_noise", "plugins=[rng_plugins]", "round.min_silos=2")
    config = to_dict(job("jobs/heart_disease.yaml", *overrides, f"output_dir={tmp_path / 'a'}"))
    packed = _rounds([SiloGroup(config, SILOS)], config, 2, SILOS)
    config = to_dict(job("jobs/heart_disease.yaml", *overrides, f"output_dir={tmp_path / 'b'}"))
    alone = _rounds([SiloGroup(config, [name]) for name in SILOS], config, 2, SILOS[::-1])
    for name in SILOS:
        for mine, theirs in zip(packed[name], alone[name], strict=True):
            if isinstance(mine, dict):
                assert all(np.array_equal(mine[k], theirs[k]) for k in mine), name
            else:
                assert mine == theirs, name


def test_each_silos_torch_generator_stays_its_own_once_its_model_is_built(job, tmp_path):
    """Set-up seeds a silo's generators by its name; building the federation's model (the same
    initial weights everywhere) must not leave every silo on one torch stream after it."""
    from silo_pfl.silo import Silo

    config = to_dict(job("jobs/heart_disease.yaml", f"output_dir={tmp_path}"))
    draws = {}
    for name in SILOS:
        silo = Silo(config, name)
        info = silo.setup()
        silo.build(info.input_shape, info.num_classes)
        draws[name] = torch.rand(3)
    first, *others = draws.values()
    assert all(not torch.equal(first, other) for other in others), draws


def test_a_group_calls_only_the_silo_api(job, tmp_path):
    config = to_dict(job("jobs/heart_disease.yaml"))
    group = SiloGroup(config, ["cleveland"])
    with pytest.raises(AttributeError):
        group.call("cleveland", "_checkpoint", 0)
    with pytest.raises(KeyError):
        group.call("va", "setup")


def _final(result) -> dict[str, np.ndarray]:
    """The global keys and every silo's last committed local state."""
    arrays = dict(np.load(result.global_state_path))
    for silo in result.silos:
        folder = Path(result.run_dir) / "silos" / silo / CHECKPOINTS
        saved = checkpoint.load(folder, checkpoint.rounds(folder)[-1])
        saved["selected_state"] = checkpoint.load(
            folder.parent / SELECTED, json.loads(saved["figures"])["selected"]["round"]
        )
        for part in ("local", "selected_state"):
            for key, value in (saved[part] or {}).items():
                arrays[f"{silo}/{part}/{key}"] = np.asarray(value)
    return arrays


def _links(result) -> set[int]:
    """The link counts of the files that hold the global keys of the run's silos' models."""
    silos = Path(result.run_dir) / "silos"
    return {path.stat().st_nlink for path in silos.glob(f"*/{GLOBAL_PART}/round-*.ckpt")}


@pytest.mark.usefixtures("ray_local")
def test_a_packed_run_on_ray_equals_a_silo_per_process_bit_for_bit(tmp_path):
    """Also with a model whose global keys each worker writes once a round for all its silos."""
    common = [
        "rounds=3",
        "data.num_silos=6",
        "tracking.enabled=false",
        "train.local_epochs=1",
        "model.name=mlp",
        "model.hidden=[2048,512]",
    ]
    results = {}
    for per_worker in ("1", "3"):
        out = f"output_dir={tmp_path / per_worker}"
        overrides = [*common, out, f"ray.silos_per_worker={per_worker}"]
        results[per_worker] = Federation("jobs/digits_label_skew.yaml", overrides).run()
    one, packed = _final(results["1"]), _final(results["3"])
    assert set(one) == set(packed) and len(one) > 0
    for key in one:
        assert np.array_equal(one[key], packed[key]), key
    assert [s.mean_val_accuracy for s in results["1"].history] == [
        s.mean_val_accuracy for s in results["3"].history
    ]
    assert _links(results["1"]) == {1} and _links(results["3"]) == {3}


@pytest.mark.usefixtures("ray_local")
def test_a_packed_silo_whose_fit_raises_is_left_out_alone(tmp_path):
    """va's fit raises in round 2: va is left out with its error; the silo packed with it and the
    others are aggregated, and va takes part again from round 3."""
    overrides = [
        "plugins=[tests.fault_plugins]",
        "algorithm.name=raise_once",
        "algorithm.raise_once.silo=va",
        "algorithm.raise_once.round=2",
        "round.min_silos=3",
        "rounds=3",
        "ray.silos_per_worker=2",
        "tracking.enabled=false",
        f"output_dir={tmp_path}",
    ]
    result = Federation("jobs/heart_disease.yaml", overrides).run()
    second = result.history[1]
    assert second.absent == {"va": "failed: RuntimeError: disk full"}
    assert second.participants == ["cleveland", "hungarian", "switzerland"]
    assert result.history[2].participants == ["cleveland", "hungarian", "switzerland", "va"]


def test_a_restarted_worker_holds_its_silos_as_lost_until_each_rejoins(job):
    """Ray brings a dead worker back empty, whether a call was in flight or not. Each of its
    silos then answers SiloLost (which the driver counts as a death, and rejoins) until it has
    rejoined itself: the first to rejoin opens the worker again, and its housemates are still
    lost, not fresh silos that were never set up."""
    from silo_pfl.config_views import actor_view
    from silo_pfl.messages import CallFailed
    from silo_pfl.runtime.actors import Opening, SiloHost

    cfg = job("jobs/heart_disease.yaml", "round.min_silos=1")
    config = to_dict(cfg)
    opening = Opening(actor_view(config, SILOS), SILOS, "run", None)
    host = SiloHost()
    host.open(*opening.args())
    infos = [host.group.call(n, "setup") for n in SILOS]  # host.call's setup asks Ray
    info = infos[0]
    for name in SILOS:
        host.call(name, "build", info.input_shape, info.num_classes)
    server = new_server(config, info.input_shape, info.num_classes)
    fit = (server.global_state(), 1)

    host = SiloHost()  # restarted by Ray: __init__ only
    answers = host.many(None, False, "fit", list(SILOS), 2, None, *fit)[1]
    assert all(isinstance(a, CallFailed) and a.lost for a in answers), answers
    rejoined = host.rejoin(SILOS[0], opening, info.input_shape, info.num_classes, {}, 0)
    assert rejoined.round == 0
    (own,), (housemate,) = (host.many(None, False, "fit", [n], 2, None, *fit)[1] for n in SILOS)
    assert not isinstance(own, CallFailed)
    assert isinstance(housemate, CallFailed) and housemate.lost, housemate
    host.rejoin(SILOS[1], opening, info.input_shape, info.num_classes, {}, 0)
    assert not isinstance(
        host.many(None, False, "fit", [SILOS[1]], 2, None, *fit)[1][0], CallFailed
    )
