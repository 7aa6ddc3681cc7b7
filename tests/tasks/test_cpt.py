"""CPT helpers: the forgetting monitor on a constructed forgetting case, the replay mixture, the
launch (tenth of the peak LR, fresh optimizer, WSD), held-out loss, and HF import as a base."""

from __future__ import annotations

import pytest
import torch

from model.checkpoint import load_model
from model.config import ModelConfig
from model.model import SmolLM3
from tasks.cpt import CptConfig, cpt_weights, forgetting_flags, general_weights
from tasks.heldout import heldout_loss
from tasks.pin import write_model_checkpoint


def test_forgetting_is_flagged_when_general_loss_rises_past_the_threshold():
    history = [
        {"step": 0, "general": 3.00, "domain": 4.00},
        {"step": 10, "general": 3.05, "domain": 3.60},  # +1.7%: fine
        {"step": 20, "general": 3.20, "domain": 3.30},  # +6.7%: forgetting
        {"step": 30, "general": 3.45, "domain": 3.10},  # +15%
    ]
    rows = forgetting_flags(history, threshold=0.05)
    assert [r["forgetting"] for r in rows] == [False, False, True, True]
    assert rows[2]["general_rise"] == pytest.approx(0.2 / 3)
    assert [r["forgetting"] for r in forgetting_flags(history, threshold=0.2)] == [False] * 4
    # A run whose general loss keeps falling never flags.
    steady = [{"step": s, "general": 3.0 - 0.01 * s, "domain": 4.0} for s in range(5)]
    assert not any(r["forgetting"] for r in forgetting_flags(steady, 0.01))
    with pytest.raises(ValueError, match="base general loss must be > 0"):
        forgetting_flags([{"step": 0, "general": 0.0}], 0.05)


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
    from tasks.cpt import cpt_stage
    from tasks.pin import BaseCheckpoint

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


def test_heldout_loss_matches_the_model_loss_and_hf_import_becomes_a_base(tmp_path):
    from model.hf import export_hf, import_hf

    torch.manual_seed(0)
    cfg = ModelConfig.tiny(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1, max_seq_len=64
    )
    model = SmolLM3(cfg)
    model.init_weights(seed=0)
    model.eval()
    tokens = torch.randint(1, 64, (16 * 8 + 1,))
    mean, se = heldout_loss(model, tokens, seq_len=16, batch=3, eos_id=0)
    with torch.no_grad():
        x, y = tokens[:-1].view(8, 16), tokens[1:].view(8, 16)
        ref = model(x, torch.zeros_like(x), y).loss.item()
    assert mean == pytest.approx(ref, rel=1e-5) and se > 0
    with pytest.raises(ValueError, match="shorter than one 16-token window"):
        heldout_loss(model, tokens[:10], 16, 3, 0)

    folder = export_hf(model, tmp_path / "hf")
    ckpt = write_model_checkpoint(import_hf(folder), tmp_path / "ckpt" / "step_00000000")
    loaded = load_model(ckpt)
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
