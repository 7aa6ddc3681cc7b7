"""Base checkpoints of continuations (tasks/pin.py): resolution through lineage (stable phase,
running stages, incomplete checkpoints, explicit bases), the stage's own spec, and pinning."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flows.anneal import anneal_runs, anneal_stage
from flows.recipe import AnnealConfig, CandidateConfig
from pipeline.workspace import Workspace
from tasks.pin import pin, resolve_base
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


def test_pin_links_the_checkpoint_so_pruning_the_original_does_not_matter(run_ws, tmp_path):
    import shutil

    ws, folders = run_ws
    base = resolve_base(ws.lineage(), ws)
    out = tmp_path / "pin"
    (folders["stage2"] / "checkpoints" / "step_00000003" / "model_config.json").write_text("{}")
    base = resolve_base(ws.lineage(), ws)
    meta = pin(base.pin_spec(), out=out)
    pinned = Path(meta["checkpoint"])
    # Same filesystem: pinned by hard links, so a multi-GB checkpoint costs no copy.
    assert (pinned / "trainer_state.json").stat().st_nlink == 2
    shutil.rmtree(base.checkpoint)  # the main run's retention deletes it
    from model.checkpoint import read_marker

    assert read_marker(pinned) is not None  # the pinned copy passes the checkpoint's manifest
    assert meta["global_step"] == 8 and meta["source"] == base.checkpoint
    assert json.loads((pinned / "trainer_state.json").read_text())["global_step"] == 8


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
