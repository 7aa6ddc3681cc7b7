"""Tests for model/config.py: presets, exact parameter counts, validation."""

from __future__ import annotations

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
