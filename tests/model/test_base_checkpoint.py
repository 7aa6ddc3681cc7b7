"""Base checkpoints of continuations (model/base_checkpoint.py): resolution through lineage
(stable phase, running stages, incomplete checkpoints, explicit bases), the stage's own spec, an
HF base refused naming what our model cannot hold, and an imported HF model as a model-only
checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from flows.anneal import anneal_runs, anneal_stage
from flows.recipe import AnnealConfig, CandidateConfig
from model.base_checkpoint import resolve_base, write_model_checkpoint
from model.checkpoint import load_model
from model.config import ModelConfig
from model.model import SmolLM3
from pipeline.workspace import Workspace
from tests.tasks.conftest import _checkpoint


def test_default_base_is_the_newest_complete_stable_checkpoint_of_a_running_stage(run_ws):
    ws, folders = run_ws
    base = resolve_base(ws.lineage(), ws)
    assert Path(base.checkpoint) == folders["stage2"] / "checkpoints" / "step_00000003"
    assert (base.stage, base.step, base.global_step, base.run_id) == ("s", 3, 8, "run-1")
    assert base.weights == {"a": 0.75, "b": 0.25}  # the running stage's own mixture, normalised
    assert base.lr == pytest.approx(3e-3)  # stable phase: the peak
    assert len(base.shards) == 2 and base.suite == ("e" * 64)
    # The stage's spec is the one the trainer read, as the same type: nothing mapped back.
    assert base.spec.global_batch == 4 and base.spec.optimizer.lr == 3e-3 and base.spec.stage == "stage2"
    # Once stage 2 finishes more checkpoints, a new anneal takes the newer one ...
    _checkpoint(folders["stage2"], 5, 10)
    assert resolve_base(ws.lineage(), ws).global_step == 10
    # ... but never one inside the decay.
    _checkpoint(folders["stage2"], 6, 11)
    assert resolve_base(ws.lineage(), ws).global_step == 10


def test_last_phase_takes_the_final_checkpoint_of_the_last_pretrain_stage(run_ws):
    ws, folders = run_ws
    base = resolve_base(ws.lineage(), ws, phase="last")  # continued pretraining's default
    assert Path(base.checkpoint) == folders["stage3"] / "checkpoints" / "step_00000005"
    assert base.global_step == 15 and base.spec.stage == "stage3"


def test_explicit_base_and_errors(run_ws, tmp_path):
    ws, folders = run_ws
    base = resolve_base(ws.lineage(), ws, str(folders["stage1"]))
    assert base.step == 5 and base.global_step == 5
    # A context-extension checkpoint keeps its RoPE base in the anneal.
    spec = folders["stage1"] / "spec.json"
    spec.write_text(json.dumps({**json.loads(spec.read_text()), "rope_theta": 2e6}))
    base = resolve_base(ws.lineage(), ws, str(folders["stage1"]))
    runs = anneal_runs(AnnealConfig(candidates=(CandidateConfig(name="b", weights={"b": 1}),)), base)
    assert anneal_stage(AnnealConfig(), base, runs[-1]).spec.rope_theta == 2e6
    with pytest.raises(LookupError, match="feedface"):
        resolve_base(ws.lineage(), ws, "feedface")
    empty = Workspace.at(tmp_path / "empty")
    with pytest.raises(LookupError, match="no 'smollm3' run"):
        resolve_base(empty.lineage(), empty)


def test_an_hf_base_our_model_cannot_hold_is_refused_naming_each_feature(run_ws, tmp_path):
    """`pin`'s base description (continued pretraining from `base=` an HF folder) runs the same
    check as `import_hf` and the evaluator, before anything trains."""
    from transformers import SmolLM3Config, SmolLM3ForCausalLM

    ws, _ = run_ws
    cfg = SmolLM3Config(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, attention_bias=True, hidden_act="gelu", pad_token_id=None, bos_token_id=None,
        eos_token_id=None,
    )  # fmt: skip
    SmolLM3ForCausalLM(cfg).save_pretrained(tmp_path / "hf")
    with pytest.raises(ValueError, match="cannot express") as err:
        resolve_base(ws.lineage(), ws, str(tmp_path / "hf"), phase="last", allow_hf=True)
    assert "attention_bias=True" in str(err.value) and "hidden_act='gelu'" in str(err.value)
    assert f"base HF model {tmp_path / 'hf'}" in str(err.value)
    # A YaRN export is evaluated (docs/model.md "Long context: YaRN"), never trained on.
    yarn = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0, "original_max_position_embeddings": 64}
    cfg = SmolLM3Config(**{**cfg.to_dict(), "attention_bias": False, "hidden_act": "silu", "rope_parameters": yarn})
    SmolLM3ForCausalLM(cfg).save_pretrained(tmp_path / "yarn")
    with pytest.raises(ValueError, match=r"has rope scaling .*continue from the export without it"):
        resolve_base(ws.lineage(), ws, str(tmp_path / "yarn"), phase="last", allow_hf=True)


def test_an_imported_hf_model_becomes_a_model_only_base_checkpoint(tmp_path):
    from model.hf import export_hf, import_hf

    torch.manual_seed(0)
    cfg = ModelConfig.tiny(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1, max_seq_len=64
    )
    model = SmolLM3(cfg)
    model.init_weights(seed=0)
    model.eval()
    folder = export_hf(model, tmp_path / "hf")
    ckpt = write_model_checkpoint(import_hf(folder), tmp_path / "ckpt" / "step_00000000")
    loaded = load_model(ckpt)
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
