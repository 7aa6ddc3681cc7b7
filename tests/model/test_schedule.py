"""Tests for model/schedule.py, model/spec.py and model/optim.py (the trainer's small parts)."""

from __future__ import annotations

import json

import pytest
import torch

from model.model import SmolLM3
from model.optim import param_groups
from model.schedule import lr_at
from model.spec import ScheduleSpec, TrainSpec


def test_wsd_warms_up_holds_then_decays_linearly_to_min():
    spec = ScheduleSpec(kind="wsd", warmup_steps=10, decay_fraction=0.2, min_lr=0.0)
    lrs = [lr_at(i, 1.0, spec, total=100) for i in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == 1.0
    assert all(lr == 1.0 for lr in lrs[10:80])
    assert lrs[80] == pytest.approx(1 - 1 / 20) and lrs[99] == 0.0
    assert all(a > b for a, b in zip(lrs[80:], lrs[81:], strict=False))


def test_one_wsd_schedule_spans_stages():
    spec = ScheduleSpec(warmup_steps=5, decay_fraction=0.1, total_steps=100)
    whole = [lr_at(i, 2e-4, spec, 100) for i in range(100)]
    stage2 = [lr_at(60 + i, 2e-4, spec, 100) for i in range(40)]  # starts at s_2 = 60
    assert stage2 == whole[60:]


def test_cosine_reaches_min_lr():
    spec = ScheduleSpec(kind="cosine", warmup_steps=2, min_lr=0.1)
    lrs = [lr_at(i, 1.0, spec, 12) for i in range(12)]
    assert lrs[1] == 1.0 and lrs[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[1:], lrs[2:], strict=False))


def _spec_dict(**kw):
    return {
        "mixture_plan": "/p.json",
        "out_dir": "/o",
        "steps": 10,
        "global_batch": 8,
        "micro_batch": 2,
    } | kw


def test_spec_round_trips_and_refuses_unknown_or_bad_fields(tmp_path):
    spec = TrainSpec.from_dict(_spec_dict(optimizer={"lr": 2e-4}, schedule={"kind": "cosine"}))
    spec.save(tmp_path / "s.json")
    assert TrainSpec.load(tmp_path / "s.json") == spec
    assert spec.optimizer.betas == (0.9, 0.95) and spec.optimizer.weight_decay == 0.1
    with pytest.raises(ValueError, match="stpes"):
        TrainSpec.from_dict(_spec_dict(stpes=3))
    with pytest.raises(ValueError, match="spec.optimizer.*lrr"):
        TrainSpec.from_dict(_spec_dict(optimizer={"lrr": 1}))
    with pytest.raises(ValueError, match="global_batch=9"):
        TrainSpec.from_dict(_spec_dict(global_batch=9))
    with pytest.raises(ValueError, match="init_from"):
        TrainSpec.from_dict(_spec_dict(reset_optimizer=True))
    (tmp_path / "bad.json").write_text(json.dumps({"steps": 1}))
    with pytest.raises(ValueError, match="bad.json"):
        TrainSpec.load(tmp_path / "bad.json")


def test_no_weight_decay_on_embeddings_and_norms(tiny_cfg):
    model = SmolLM3(tiny_cfg)
    decay, no_decay = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    no_decay_names = {names[id(p)] for p in no_decay["params"]}
    assert "embed.weight" in no_decay_names and "norm.weight" in no_decay_names
    assert all(n.endswith("norm.weight") or n == "embed.weight" for n in no_decay_names)
    assert all(p.ndim == 2 for p in decay["params"]) and decay["weight_decay"] == 0.1
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
    assert torch.is_tensor(decay["params"][0])
