"""A silo commits a round before the driver has chosen among the silos' evaluations
(`evaluate_and_commit`), and is told the choice with its next call or by `select`: it ends with
the selected model, figures and published file that an immediate `commit(round, keep)` gives,
and its checkpoint holds that choice. Plain classes, no Ray."""

from __future__ import annotations

import pytest
import torch
from old_checkpoints import save_torch_kind

from silo_pfl import checkpoint, checkpoint_format
from silo_pfl.config import to_dict
from silo_pfl.server_start import new_server
from silo_pfl.silo import Silo
from silo_pfl.silo_store import CHECKPOINTS, MODELS, SELECTED

SILO = "cleveland"
JOB = ("jobs/heart_disease.yaml", "algorithm.name=fedper", "round.min_silos=1")
# keep[r - 1]: whether selection chose round r's model. The first leaves round 2 selected while
# later models are written past checkpoint.KEEP; the second chooses the last round, which the
# silo hears of only from `select`.
KEEPS = ([True, True, False, False, False, False], [True, False, False, True])


def play(config: dict, run_id: str, keeps: list[bool], later: bool, told: bool = True) -> Silo:
    """Rounds of one silo and its server; the silo commits each round at once with the choice
    (`later` False), or before it, told the choice a round late, then by `select` (unless not
    `told`)."""
    silo = Silo(config, SILO, run_id)
    info = silo.setup()
    silo.build(info.input_shape, info.num_classes)
    server = new_server(config, info.input_shape, info.num_classes)
    selected = None
    for round_, keep in enumerate(keeps, start=1):
        update, _ = silo.fit(server.global_state(), round_, 1, server.broadcast())
        assert server.aggregate(update).aggregated
        if later:
            silo.evaluate_and_commit(server.global_state(), round_, selected)
        else:
            silo.evaluate(server.global_state(), round_)
            silo.commit(round_, keep)
        selected = round_ if keep else selected
    if later and told:
        silo.select(selected)
    return silo


def load_model(silo: Silo) -> dict:
    """The silo's selected model, read back and checked against its checkpoint's digest."""
    selected = silo.outcome().selected_round
    return checkpoint.load(silo.dir / SELECTED, selected, silo._selected_sha256)


def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("keeps", KEEPS, ids=["kept-early", "kept-last"])
def test_a_choice_told_later_selects_what_an_immediate_one_does(job, tmp_path, keeps):
    config = to_dict(job(*JOB, f"output_dir={tmp_path}"))
    now = play(config, "now", keeps, later=False)
    later = play(config, "later", keeps, later=True)
    chosen = max(r for r, keep in enumerate(keeps, start=1) if keep)

    assert later.outcome() == now.outcome()
    assert later.outcome().selected_round == chosen
    assert_same_state(load_model(later), load_model(now))
    rounds = len(keeps)
    folder = later.dir / CHECKPOINTS
    models = [r for r in checkpoint.rounds(folder) if "model" in checkpoint.load(folder, r)]
    newest = {rounds - 2, rounds - 1, rounds}
    assert newest | {chosen} <= set(models)
    assert len(set(models) - newest - {chosen}) <= 1  # selected before; pruned by the next write
    if keeps == KEEPS[0]:
        assert set(models) == newest | {chosen}  # round 2's model outlived checkpoint.KEEP

    again = Silo(config, SILO, "later")
    info = again.setup(resume=True)
    again.build(info.input_shape, info.num_classes)
    again.restore(rounds)
    assert again.outcome() == now.outcome()
    assert chosen in checkpoint.rounds(folder), "a resumed silo keeps its selected round's model"


def test_a_silo_cannot_select_a_model_it_never_wrote(job, tmp_path):
    config = to_dict(job(*JOB, f"output_dir={tmp_path}"))
    silo = play(config, "run", [True, False], later=True)
    with pytest.raises(Exception, match=f"silo {SILO}: no model of round 7 to select"):
        silo.select(7)


def as_older_code_wrote_it(silo: Silo) -> None:
    """Rewrite a silo's directory as the code before 2026-12-05 left it: each checkpoint in
    torch's kind with its tensors, and each round's model in a file of its own (MODELS)."""
    folder = silo.dir / CHECKPOINTS
    for round_ in checkpoint.rounds(folder):
        state = checkpoint.load(folder, round_)
        model = state.pop("model", None)
        if model is not None:
            checkpoint.save_arrays(silo.dir / MODELS, round_, model)
        for part in ("local", "algorithm"):
            state[part] = {k: torch.from_numpy(v) for k, v in state[part].items()}
        save_torch_kind(folder, round_, state)


def test_a_silo_of_an_older_run_resumes_and_publishes_its_model_from_its_own_file(job, tmp_path):
    """A run resumed across the change: its checkpoints of torch's kind restore the silo, and
    the model selection chooses is read from MODELS, where the older code wrote it."""
    config = to_dict(job(*JOB, f"output_dir={tmp_path}"))
    keeps = [True, False, True, False]
    now = play(config, "now", keeps, later=False)
    older = play(config, "older", keeps, later=True, told=False)
    as_older_code_wrote_it(older)
    assert not any("model" in checkpoint.load(older.dir / CHECKPOINTS, r) for r in (2, 3, 4))

    again = Silo(config, SILO, "older")
    info = again.setup(resume=True)
    again.build(info.input_shape, info.num_classes)
    again.restore(len(keeps))
    again.select(3)
    assert again.outcome() == now.outcome()
    assert_same_state(load_model(again), load_model(now))
    rewritten = checkpoint.path_of(again.dir / CHECKPOINTS, len(keeps)).read_bytes()
    assert rewritten.startswith(checkpoint_format.ARRAYS_MAGIC)  # the choice, in this code's kind

    last = Silo(config, SILO, "older")
    info = last.setup(resume=True)
    last.build(info.input_shape, info.num_classes)
    last.restore(len(keeps))
    assert last.outcome() == now.outcome()


@pytest.mark.parametrize("damage", ["garbage", "missing"])
def test_a_damaged_published_model_is_written_again_from_its_checkpoint_on_resume(
    job, tmp_path, capsys, damage
):
    """The selected model's published file damaged or gone since (a disk's fault, a hand): the
    resumed silo writes it again from its round's checkpoint, says so, and goes on."""
    config = to_dict(job(*JOB, f"output_dir={tmp_path}"))
    keeps = KEEPS[0]
    silo = play(config, "run", keeps, later=False)
    before = load_model(silo)
    published = silo.selected_path
    if damage == "garbage":
        published.write_bytes(b"garbage")
    else:
        published.unlink()

    again = Silo(config, SILO, "run")
    info = again.setup(resume=True)
    again.build(info.input_shape, info.num_classes)
    again.restore(len(keeps))
    assert again.outcome() == silo.outcome()
    assert again.selected_path == published
    assert_same_state(load_model(again), before)
    err = capsys.readouterr().err
    assert f"warning: silo {SILO}: checkpoint {published}" in err, err
    assert err.rstrip().endswith("; written again from its round's checkpoint"), err
