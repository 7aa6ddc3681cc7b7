"""The CPT flow's plan (flows/cpt.py): the replay mixture and the launch (a tenth of the peak LR,
fresh optimizer, WSD)."""

from __future__ import annotations

import pytest

from flows.cpt import cpt_stage, cpt_weights, general_weights
from model.base_checkpoint import BaseCheckpoint
from tasks.cpt import CptConfig


def test_replay_mixture_and_general_data():
    cfg = CptConfig(domain={"math": 1.0}, replay=0.1)
    general = general_weights(cfg, {"prose": 0.2, "code": 0.6, "math": 0.2})
    assert general == {"prose": 0.2, "code": 0.6}  # the base mixture minus the new domain
    assert cpt_weights(cfg, general) == pytest.approx({"code": 0.075, "math": 0.9, "prose": 0.025})
    with pytest.raises(ValueError, match="no general data to replay"):
        general_weights(cfg, {"math": 1.0})
    with pytest.raises(ValueError, match="cpt.domain names no new-domain source"):
        cpt_weights(CptConfig(), general)


def test_cpt_launch_is_a_tenth_of_the_peak_with_fresh_optimizer(tmp_path):
    from model.spec import OptimizerConfig, TrainSpec

    spec = TrainSpec(
        stage="stage3", steps=20, global_batch=8, micro_batch=8, seq_len=64, seed=7, optimizer=OptimizerConfig(lr=3e-3)
    )
    base = BaseCheckpoint(
        checkpoint="c",
        digest="d",
        stage="stage3",
        step=5,
        global_step=80,
        lr=0.0,
        spec=spec,
        weights={"a": 1.0},
        run_id=None,
        shards=(),
        tokenizer="t",
        suite=None,
        model_shape={"vocab_size": 100, "hidden_size": 32, "max_seq_len": 64},
    )
    cfg = CptConfig(domain={"a": 1}, tokens=8 * 64 * 10, eval_interval=3, warmup_steps=2, decay_fraction=0.2)
    run = cpt_stage(cfg, base)
    assert run.spec.steps == 10 and run.spec.optimizer.lr == pytest.approx(3e-4)
    assert run.spec.reset_optimizer and run.spec.reset_schedule and run.spec.seed == 7
    assert run.spec.schedule.model_dump() == {
        "kind": "wsd",
        "warmup_steps": 2,
        "decay_fraction": 0.2,
        "min_lr": 0.0,
        "total_steps": 10,
        "start_step": 0,
    }
    assert run.keep_every == 3  # the monitor reads a checkpoint every interval: all kept
    assert run.spec.model_overrides == {"vocab_size": 100, "hidden_size": 32}  # the base's own shape
