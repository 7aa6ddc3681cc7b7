"""Tests for model/config.py: presets, exact parameter counts, validation."""

from __future__ import annotations

import json
import math

import pytest
import torch

from model.config import ModelConfig
from model.model import SmolLM3


def test_smollm3_3b_has_exactly_the_published_parameter_count():
    cfg = ModelConfig.smollm3_3b()
    assert cfg.num_parameters() == 3_075_098_624
    with torch.device("meta"):  # shapes only: nothing is allocated
        model = SmolLM3(cfg)
    assert model.num_parameters() == 3_075_098_624
    nope = [i for i in range(36) if not model.layers[i].attn.use_rope]
    assert nope == list(range(3, 36, 4))


def test_ablation_1b_matches_llama_3_2_1b_count():
    cfg = ModelConfig.ablation_1b()
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (16, 2048, 32, 8)
    assert cfg.num_parameters() == 1_235_814_400  # Llama-3.2-1B, tied embeddings


def test_tiny_is_small_and_takes_the_vocab_from_the_caller():
    cfg = ModelConfig.tiny(vocab_size=1000)
    assert cfg.vocab_size == 1000
    assert 1_000_000 <= ModelConfig.tiny().num_parameters() <= 8_000_000
    with torch.device("meta"):
        assert SmolLM3(cfg).num_parameters() == cfg.num_parameters()


def test_from_preset_applies_overrides_and_lists_allowed_names():
    cfg = ModelConfig.from_preset("smollm3-3b", rope_theta=2e6)
    assert cfg.rope_theta == 2e6 and cfg.num_layers == 36
    with pytest.raises(ValueError, match="ablation_1b, smollm3_3b, tiny"):
        ModelConfig.from_preset("gpt2")
    with pytest.raises(ValueError, match="hiden_size"):
        ModelConfig.from_preset("tiny", hiden_size=3)


@pytest.mark.parametrize(
    "bad, field",
    [
        ({"hidden_size": 65}, "hidden_size"),
        ({"num_kv_heads": 3}, "num_kv_heads"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"rope_theta": 0.0}, "rope_theta"),
        ({"no_rope_interval": -1}, "no_rope_interval"),
        ({"z_loss": -1.0}, "z_loss"),
    ],
)
def test_invalid_fields_are_named(bad, field):
    with pytest.raises(ValueError, match=field):
        ModelConfig.tiny(**bad)


def test_round_trips_through_a_dict():
    cfg = ModelConfig.tiny(vocab_size=77, qk_norm=True)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg


def test_yarn_settings_are_checked_and_round_trip_through_a_dict():
    from model.config import RopeScaling

    cfg = ModelConfig.tiny(max_seq_len=512).with_yarn(2)
    assert cfg.rope_scaling == RopeScaling(2.0, 512) and cfg.max_seq_len == 1024
    assert cfg.rope_scaling.cos_sin_scale == pytest.approx(0.1 * math.log(2) + 1)
    assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    # Unset, the dict is what it was before YaRN existed (checkpoint configs read back equal).
    assert "rope_scaling" not in ModelConfig.tiny().to_dict()
    bad = {  # each bad setting, the words its refusal names it by
        "factor": ({"factor": 0.5, "original_max_position_embeddings": 64}, "RopeScaling.factor must be >= 1"),
        "original": ({"factor": 2.0, "original_max_position_embeddings": 0}, "original_max_position_embeddings"),
        "betas": ({"factor": 2.0, "original_max_position_embeddings": 64, "beta_fast": 1, "beta_slow": 4}, "beta_fast"),
        "unknown": ({"factor": 2.0, "original_max_position_embeddings": 64, "mscale": 1}, "rope_scaling fields"),
    }
    for scaling, words in bad.values():
        with pytest.raises(ValueError, match=words):
            ModelConfig.tiny(rope_scaling=scaling)
