"""model/model_card.py: the README.md of an HF export says what the model is and where it came from."""

from __future__ import annotations

import dataclasses

from model.config import ModelConfig
from model.model_card import model_card, read_spec


def test_the_card_holds_the_stage_the_data_and_the_lineage(tmp_path):
    (tmp_path / "spec.json").write_text(
        '{"optimizer": {"lr": 0.003, "betas": [0.9, 0.95], "weight_decay": 0.1, "grad_clip": 1.0},'
        ' "schedule": {"kind": "wsd", "warmup_steps": 10}}'
    )
    meta = {
        "stage": "stage2",
        "kind": "pretrain",
        "steps": 16,
        "seq_len": 256,
        "tokens": 98304,
        "final_loss": 3.21,
        "tokens_per_source": {"prose": 60000, "code": 30000, "math": 8304},
        "init_from": "pretrain/abc/checkpoints/step_00000016",
    }
    card = model_card(
        stage_meta=meta,
        spec=read_spec(tmp_path),
        architecture=dataclasses.asdict(ModelConfig.tiny(vocab_size=4096)),
        checkpoint_fingerprint="c" * 64,
        export_id="0123456789ab",
        parameters=1_234_567,
        dtype="float32",
    )
    assert card.startswith("---\nlibrary_name: transformers\n")
    assert "# SmolLM3-style model: stage `stage2`" in card and "1,234,567 parameters, float32 weights" in card
    assert "- stage: `stage2` (pretrain), 16 steps at sequence length 256, 98,304 tokens" in card
    assert "- final training loss: 3.2100" in card and "hidden_size 256" in card and "vocab_size 4096" in card
    assert "- optimizer: AdamW, lr 0.003, betas [0.9, 0.95], weight decay 0.1, gradient clip 1.0" in card
    assert '"kind": "wsd"' in card and "initialised from the previous stage" in card
    assert "| prose | 60,000 | 61.0% |" in card.splitlines()  # sources by tokens drawn, largest first
    assert card.index("| prose |") < card.index("| code |") < card.index("| math |")
    assert f"- checkpoint fingerprint: `{'c' * 64}`" in card and "`export/0123456789ab`" in card
    assert "--descendants" in card  # where its evaluations are


def test_a_stage_without_its_spec_or_counts_still_gets_a_card(tmp_path):
    card = model_card(
        stage_meta={"stage": "long1"},
        spec=read_spec(tmp_path / "gone"),
        architecture={},
        checkpoint_fingerprint="d" * 64,
        export_id="x",
        parameters=10,
        dtype="bfloat16",
    )
    assert "- final training loss: not recorded" in card and "recorded no per-source token counts" in card
    assert "optimizer" not in card and "architecture" not in card
