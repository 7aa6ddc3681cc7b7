"""Tests for model/checkpoint.py: DCP save/load, completion markers, retention, truncation."""

from __future__ import annotations

import json
import logging

import pytest
import torch
import torch.distributed as dist

from model.checkpoint import Checkpointer, load_model, read_marker, resolve_checkpoint
from model.model import SmolLM3
from model.optim import build_optimizer
from model.spec import OptimizerSpec


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _trained(cfg, steps=1, seed=0):
    torch.manual_seed(seed)
    model = SmolLM3(cfg)
    opt = build_optimizer(model, OptimizerSpec(lr=1e-2))
    ids = torch.randint(0, cfg.vocab_size, (2, 8))
    for _ in range(steps):
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _save_steps(ckpt, cfg, steps, stage_end=()):
    models = {}
    for step in steps:
        model, opt = _trained(cfg, seed=step)
        ckpt.save(step, model, opt, {"loader": {"sequence": step}}, stage_end=step in stage_end)
        models[step] = model
    return models


def test_save_then_load_restores_model_optimizer_and_state(one_rank_group, tiny_cfg, tmp_path):
    ckpt = Checkpointer(tmp_path / "ckpt")
    model, opt = _trained(tiny_cfg, steps=2)
    folder = ckpt.save(7, model, opt, {"loader": {"sequence": 42}})
    assert folder.name == "step_00000007"
    marker = read_marker(folder)
    assert marker["step"] == 7 and "trainer_state.json" in marker["files"]

    fresh, fresh_opt = _trained(tiny_cfg, steps=0, seed=99)
    state = ckpt.load(folder, fresh, fresh_opt)
    assert state["loader"] == {"sequence": 42} and state["step"] == 7
    for name, tensor in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name
    saved_moments = opt.state_dict()["state"]
    loaded_moments = fresh_opt.state_dict()["state"]
    for idx, moments in saved_moments.items():
        assert torch.equal(loaded_moments[idx]["exp_avg_sq"], moments["exp_avg_sq"])
        assert float(loaded_moments[idx]["step"]) == 2.0


def test_truncated_or_unmarked_newest_is_skipped_with_a_warning(
    one_rank_group, tiny_cfg, tmp_path, caplog
):
    ckpt = Checkpointer(tmp_path / "ckpt", keep_last=5)
    models = _save_steps(ckpt, tiny_cfg, [1, 2, 3])
    shard = next((ckpt.root / "step_00000003").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # truncated, marker intact
    (ckpt.root / "step_00000004").mkdir()  # a save killed before its marker
    with caplog.at_level(logging.WARNING, logger="model.checkpoint"):
        latest = ckpt.latest()
    assert latest.name == "step_00000002"
    assert "step_00000004" in caplog.text and "step_00000003" in caplog.text
    loaded = load_model(tmp_path / "ckpt")  # also what export uses, without a process group
    for name, tensor in models[2].state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    with pytest.raises(FileNotFoundError, match="step_00000003"):
        resolve_checkpoint(ckpt.root / "step_00000003")


def test_retention_keeps_last_k_and_every_stage_end(one_rank_group, tiny_cfg, tmp_path):
    ckpt = Checkpointer(tmp_path / "ckpt", keep_last=2)
    _save_steps(ckpt, tiny_cfg, [1, 2, 3, 4, 5], stage_end={2})
    assert [f.name for f in ckpt.step_folders()] == [
        "step_00000002",
        "step_00000004",
        "step_00000005",
    ]
    assert json.loads((ckpt.root / "step_00000002" / "COMPLETE").read_text())["stage_end"]


def test_a_leftover_folder_at_the_same_step_is_replaced(one_rank_group, tiny_cfg, tmp_path):
    ckpt = Checkpointer(tmp_path / "ckpt")
    (ckpt.root / "step_00000003").mkdir(parents=True)
    (ckpt.root / "step_00000003" / "junk.distcp").write_bytes(b"x")
    model, opt = _trained(tiny_cfg)
    folder = ckpt.save(3, model, opt, {})
    assert not (folder / "junk.distcp").exists() and read_marker(folder) is not None
