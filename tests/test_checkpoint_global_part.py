"""A large model's global keys go into a file of their own in each silo's checkpoint, which the
silos of one worker that evaluated the same global state share as one file hard-linked: a round
writes them once per worker, not once per silo. Each silo still reads back, publishes and
resumes its own model bit for bit. Plain classes, no Ray."""

from __future__ import annotations

import numpy as np
import pytest

from silo_pfl import checkpoint, durable
from silo_pfl.config import to_dict
from silo_pfl.server_start import new_server
from silo_pfl.silo import Silo
from silo_pfl.silo_store import CHECKPOINTS, GLOBAL_PART, SELECTED
from silo_pfl.tensor_state import as_arrays

LARGE = ("model.name=mlp", "model.hidden=[2048,512]")  # FedPer: 1.18M global values, 4.7 MB
JOB = ("jobs/digits_label_skew.yaml", "data.num_silos=5", "round.min_silos=1")
ROUNDS = 5


def worker(config: dict) -> tuple[list[Silo], dict[str, dict[int, dict]]]:
    """Rounds of three silos as one worker runs them: each round's evaluations and commits in
    one durable block. Returns the silos and each one's evaluated model of every round."""
    silos = [Silo(config, f"silo_{i}") for i in range(3)]
    for silo in silos:
        info = silo.setup()
        silo.build(info.input_shape, info.num_classes)
    server = new_server(config, info.input_shape, info.num_classes)
    evaluated: dict[str, dict[int, dict]] = {silo.name: {} for silo in silos}
    for round_ in range(1, ROUNDS + 1):
        updates = [silo.fit(server.global_state(), round_)[0] for silo in silos]
        assert server.aggregate(*updates).aggregated
        with durable.durable_together():
            for silo in silos:
                silo.evaluate_and_commit(server.global_state(), round_, round_ - 1 or None)
                model = as_arrays(silo._evaluated.state_dict())
                evaluated[silo.name][round_] = {k: v.copy() for k, v in model.items()}
    return silos, evaluated


def assert_same(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and np.array_equal(a[key], b[key]), key


def test_a_worker_writes_a_rounds_global_keys_once_and_each_silo_reads_its_model_back(
    job, tmp_path
):
    silos, evaluated = worker(to_dict(job(*JOB, *LARGE, f"output_dir={tmp_path}")))
    first = silos[0]
    global_keys = set(first.split.global_keys)
    kept = checkpoint.rounds(first.dir / GLOBAL_PART)
    assert kept == checkpoint.rounds(first.dir / CHECKPOINTS) == [3, 4, 5]
    for round_ in kept:
        files = [checkpoint.path_of(silo.dir / GLOBAL_PART, round_).stat() for silo in silos]
        assert {f.st_ino for f in files} == {files[0].st_ino}, round_
        assert files[0].st_nlink == 3
        assert files[0].st_size > 4_000_000  # the global keys, once
        for silo in silos:
            saved = checkpoint.load(silo.dir / CHECKPOINTS, round_)
            assert set(saved["model"]) == set(saved["model"]) - global_keys
            assert_same(silo.store.saved_model(round_), evaluated[silo.name][round_])
            assert (silo.dir / CHECKPOINTS / f"round-{round_:06d}.ckpt").stat().st_size < 100_000

    for silo in silos:  # the last round selected: published from the two files
        silo.select(ROUNDS)
        published = checkpoint.load(silo.dir / SELECTED, ROUNDS, silo._selected_sha256)
        assert_same({k: v.numpy() for k, v in published.items()}, evaluated[silo.name][ROUNDS])
        assert not list((silo.dir / GLOBAL_PART).glob(".*"))  # no temporary name left behind
    assert checkpoint.path_of(first.dir / GLOBAL_PART, ROUNDS).stat().st_nlink == 3

    again = Silo(first.cfg, first.name)  # after a restart: the same model, read back
    info = again.setup(resume=True)
    again.build(info.input_shape, info.num_classes)
    again.restore(ROUNDS)
    assert_same(again.store.saved_model(4), evaluated[first.name][4])


def test_a_damaged_or_swapped_global_part_is_named(job, tmp_path):
    silos, _ = worker(to_dict(job(*JOB, *LARGE, f"output_dir={tmp_path}")))
    silo = silos[1]
    path = checkpoint.path_of(silo.dir / GLOBAL_PART, 4)
    with open(path, "r+b") as handle:
        handle.seek(path.stat().st_size // 2)
        byte = handle.read(1)
        handle.seek(-1, 1)
        handle.write(bytes([byte[0] ^ 1]))
    with pytest.raises(checkpoint.CheckpointError, match=f"{path}: corrupted"):
        silo.store.saved_model(4)
    path.unlink()
    path.hardlink_to(checkpoint.path_of(silo.dir / GLOBAL_PART, 5))  # round 5's, as 4's
    with pytest.raises(checkpoint.CheckpointError, match=f"{path}: not the one expected"):
        silo.store.saved_model(4)


def test_a_small_model_is_kept_whole_in_the_checkpoint(job, tmp_path):
    silos, evaluated = worker(to_dict(job(*JOB, f"output_dir={tmp_path}")))
    for silo in silos:
        assert not (silo.dir / GLOBAL_PART).exists()
        saved = checkpoint.load(silo.dir / CHECKPOINTS, ROUNDS)
        assert_same(saved["model"], evaluated[silo.name][ROUNDS])
