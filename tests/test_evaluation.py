"""A silo's evaluation: its validation and test rows scored in one pass of its model, each part
exactly as `evaluate` scores it alone. Plain Silo and Server classes on the digits data."""

from __future__ import annotations

import math

import pytest
import torch

from silo_pfl.config import to_dict
from silo_pfl.data import silo_names
from silo_pfl.server import Server
from silo_pfl.server_start import new_server
from silo_pfl.silo import Silo
from silo_pfl.training import evaluate, evaluate_parts

JOB = "jobs/digits_label_skew.yaml"


def built_silo(job) -> tuple[Silo, Server]:
    """The digits job's first silo (cnn_small_bn: BatchNorm judged in eval mode), and its server."""
    cfg = job(JOB, "algorithm.name=fedbn", "model.name=cnn_small_bn")
    config = to_dict(cfg)
    silo = Silo(config, silo_names(cfg.data)[0])
    info = silo.setup()
    silo.build(info.input_shape, info.num_classes)
    return silo, new_server(config, info.input_shape, info.num_classes)


def test_each_part_scores_as_evaluate_scores_it_alone(job):
    silo, _ = built_silo(job)
    sizes = len(silo.val_xy[1]), len(silo.test_xy[1])
    assert min(sizes) > 0
    val, test = evaluate_parts(silo.model, *silo.held_out_xy, sizes)
    each_alone = evaluate(silo.model, *silo.val_xy), evaluate(silo.model, *silo.test_xy)
    for part, alone in zip((val, test), each_alone, strict=True):
        assert part.count == alone.count
        assert part.accuracy == alone.accuracy
        assert part.loss == pytest.approx(alone.loss, rel=1e-5)
    batched = evaluate_parts(silo.model, *silo.held_out_xy, sizes, batch_size=7)
    assert [r.accuracy for r in batched] == [val.accuracy, test.accuracy]
    assert [r.loss for r in batched] == pytest.approx([val.loss, test.loss], rel=1e-5)


def test_an_empty_part_has_no_score_and_the_parts_must_cover_the_rows(job):
    silo, _ = built_silo(job)
    x, y = silo.val_xy
    empty, whole = evaluate_parts(silo.model, x, y, (0, len(y)))
    assert empty.count == 0 and math.isnan(empty.accuracy) and math.isnan(empty.loss)
    assert whole.accuracy == evaluate(silo.model, x, y).accuracy
    with pytest.raises(ValueError, match="parts of"):
        evaluate_parts(silo.model, x, y, (1, len(y)))
    silo.model.train()
    nothing = evaluate_parts(silo.model, x[:0], y[:0], (0, 0))
    assert [r.count for r in nothing] == [0, 0] and all(math.isnan(r.loss) for r in nothing)
    assert silo.model.training, "no rows: the model is not even switched to eval mode"


def test_a_silo_scores_its_validation_and_test_rows_in_one_call_of_its_model(job):
    silo, server = built_silo(job)
    calls = []
    hook = silo.model.register_forward_hook(lambda module, args, out: calls.append(len(args[0])))
    try:
        metrics = silo.evaluate(server.global_state(), 1)
    finally:
        hook.remove()
    assert calls == [len(silo.held_out_xy[1])]
    assert not silo.model.training
    with torch.no_grad():
        val = evaluate(silo.model, *silo.val_xy)
        test = evaluate(silo.model, *silo.test_xy)
    assert (metrics.val_accuracy, metrics.test_accuracy) == (val.accuracy, test.accuracy)
    assert (metrics.val_loss, metrics.test_loss) == pytest.approx((val.loss, test.loss), rel=1e-5)
