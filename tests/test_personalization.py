"""Algorithms that personalize beyond the split (Ditto, local fine-tuning), on the plain Silo and
Server classes: what they send is FedAvg's update, and what they are judged by stays home."""

from __future__ import annotations

import numpy as np
import torch
from plain_federation import federation, play_round, same_updates


def test_ditto_sends_fedavgs_update_and_is_judged_by_its_personal_model(job):
    ditto, ditto_server = federation(job, "ditto", "algorithm.ditto.lam=0.1")
    fedavg, fedavg_server = federation(job, "fedavg")
    for round_ in (1, 2):
        d_updates, d_state, d_evals = play_round(ditto, ditto_server, round_)
        f_updates, f_state, f_evals = play_round(fedavg, fedavg_server, round_)
        assert same_updates(d_updates, f_updates)
        assert all(np.array_equal(d_state[k], f_state[k]) for k in f_state)
    # Judged by the personal model, not the global one FedAvg is judged by.
    assert [e.val_loss for e in d_evals] != [e.val_loss for e in f_evals]
    silo = ditto[0]
    personal = silo.algorithm.personal.state_dict()
    silo.commit(2, keep=True)
    kept = torch.load(silo.selected_path)
    assert all(torch.equal(kept[k], personal[k]) for k in personal)
    # Nothing the silo sent equals a personal weight.
    sent = [v for u in d_updates for v in u.delta.values()]
    for value in personal.values():
        assert not any(s.shape == value.shape and np.array_equal(s, value.numpy()) for s in sent)


def test_dittos_pull_keeps_the_personal_model_near_the_global_one(job):
    def distance(lam: str) -> float:
        """How far silo 0's personal model moved in round 1 from that round's global model."""
        silos, server = federation(job, "ditto", f"algorithm.ditto.lam={lam}")
        start = {k: torch.tensor(v) for k, v in server.global_state().items()}
        play_round(silos, server, 1)
        personal = silos[0].algorithm.personal.state_dict()
        return sum(float((personal[k] - start[k]).norm()) for k in start)

    assert distance("5") < 0.5 * distance("0")


def test_finetuning_sends_fedavgs_update_and_fine_tunes_only_a_copy(job):
    tuned, tuned_server = federation(job, "finetune", "algorithm.finetune.epochs=2")
    plain, plain_server = federation(job, "finetune", "algorithm.finetune.epochs=0")
    fedavg, fedavg_server = federation(job, "fedavg")
    t_updates, t_state, t_evals = play_round(tuned, tuned_server, 1)
    p_updates, _, p_evals = play_round(plain, plain_server, 1)
    f_updates, _, f_evals = play_round(fedavg, fedavg_server, 1)
    assert same_updates(t_updates, f_updates) and same_updates(p_updates, f_updates)
    assert p_evals == f_evals  # fine-tuning for 0 epochs judges FedAvg's global model
    assert [e.val_loss for e in t_evals] != [e.val_loss for e in f_evals]
    # The silo's own model still holds the global state: only the copy was fine-tuned.
    for silo in tuned:
        state = silo.model.state_dict()
        assert all(np.array_equal(state[k].numpy(), t_state[k]) for k in t_state)
