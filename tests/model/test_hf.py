"""Tests for model/hf.py: export to and import from transformers' SmolLM3ForCausalLM."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import SmolLM3Config, SmolLM3ForCausalLM

from model.hf import export_hf, import_hf, to_hf_config
from model.model import SmolLM3


@pytest.fixture
def trained_like(tiny_cfg):
    # A wider init than 0.02 makes attention patterns (and so RoPE/NoPE) matter in the logits.
    cfg = tiny_cfg.replace(init_std=0.2, rope_theta=10_000.0)
    torch.manual_seed(0)
    return SmolLM3(cfg).eval()


def test_export_loads_with_from_pretrained_and_matches_logits(trained_like, tmp_path):
    out = export_hf(trained_like, tmp_path / "hf", eos_token_id=0)
    assert (out / "model.safetensors").exists()
    config = json.loads((out / "config.json").read_text())
    assert config["no_rope_layers"] == [1, 1, 1, 0]  # 1 = RoPE, 0 = NoPE
    assert config["tie_word_embeddings"] is True
    hf = SmolLM3ForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, trained_like.config.vocab_size, (2, 24))
    with torch.no_grad():
        ours, theirs = trained_like(ids).logits, hf(ids).logits
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=0)


def test_parity_depends_on_nope_layers(trained_like, tmp_path):
    """The NoPE layer really is NoPE in both: forcing RoPE there changes HF's logits."""
    out = export_hf(trained_like, tmp_path / "hf")
    cfg = SmolLM3Config.from_pretrained(out)
    cfg.no_rope_layers = [1, 1, 1, 1]
    all_rope = SmolLM3ForCausalLM.from_pretrained(out, config=cfg).eval()
    ids = torch.randint(0, trained_like.config.vocab_size, (1, 24))
    with torch.no_grad():
        diff = (all_rope(ids).logits - trained_like(ids).logits).abs().max()
    assert diff > 1e-3


def test_round_trip_is_exact(trained_like, tmp_path):
    back = import_hf(export_hf(trained_like, tmp_path / "hf"))
    assert back.config == trained_like.config
    ours = trained_like.state_dict()
    for name, tensor in back.state_dict().items():
        assert torch.equal(tensor, ours[name]), name


def test_import_of_a_transformers_model_matches_its_logits(tmp_path):
    hf_cfg = SmolLM3Config(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        no_rope_layer_interval=3,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
    )
    torch.manual_seed(1)
    hf = SmolLM3ForCausalLM(hf_cfg).eval()
    hf.save_pretrained(tmp_path / "hf")
    ours = import_hf(tmp_path / "hf")
    assert ours.config.no_rope_interval == 3 and ours.config.num_kv_heads == 1
    ids = torch.randint(0, 96, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, hf(ids).logits, atol=1e-4, rtol=0)


def test_qk_norm_models_are_refused_by_name(tiny_cfg, tmp_path):
    with pytest.raises(ValueError, match="qk_norm"):
        export_hf(SmolLM3(tiny_cfg.replace(qk_norm=True)), tmp_path / "hf")


def test_tokenizer_is_copied_next_to_the_weights(trained_like, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    out = export_hf(trained_like, tmp_path / "hf", tokenizer_dir=tmp_path / "tok")
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(out)("hello world")["input_ids"] == [1, 2]


# The architecture options the ablation flow varies (docs/ablations.md), each exported and loaded
# by transformers' SmolLM3 with the same logits, and imported back to the same config.
ABLATION_OPTIONS = {
    "nope-none": {"no_rope_interval": 0},  # RoPE on every layer
    "nope-every-2nd": {"no_rope_interval": 2},
    "untied": {"tie_embeddings": False},
    "mha": {"num_kv_heads": 4},  # as many KV heads as query heads
    "mqa": {"num_kv_heads": 1},  # one KV head shared by all
    "rope-theta-1e6": {"rope_theta": 1_000_000.0},
}


@pytest.mark.parametrize("option", sorted(ABLATION_OPTIONS))
def test_ablation_options_have_transformers_parity(tiny_cfg, tmp_path, option):
    cfg = tiny_cfg.replace(init_std=0.2, rope_theta=10_000.0).replace(**ABLATION_OPTIONS[option])
    torch.manual_seed(0)
    ours = SmolLM3(cfg).eval()
    if not cfg.tie_embeddings:  # a head of its own, visibly different from the embedding
        assert ours.lm_head is not None and not torch.equal(ours.lm_head.weight, ours.embed.weight)
    out = export_hf(ours, tmp_path / "hf", eos_token_id=0)
    config = json.loads((out / "config.json").read_text())
    assert config["num_key_value_heads"] == cfg.num_kv_heads
    assert config["tie_word_embeddings"] is cfg.tie_embeddings
    assert config["no_rope_layers"] == [int(cfg.uses_rope(i)) for i in range(cfg.num_layers)]
    assert config["rope_parameters"]["rope_theta"] == cfg.rope_theta
    hf = SmolLM3ForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 40))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids).logits, atol=1e-4, rtol=0)
    back = import_hf(out)
    assert back.config == cfg
    for name, tensor in back.state_dict().items():
        assert torch.equal(tensor, ours.state_dict()[name]), name


def test_the_options_change_the_network(tiny_cfg):
    """Each option really changes what the model computes (so the parity above is not vacuous)."""
    cfg = tiny_cfg.replace(init_std=0.2, rope_theta=10_000.0)
    ids = torch.randint(0, cfg.vocab_size, (1, 40))
    torch.manual_seed(0)
    base = SmolLM3(cfg).eval()
    for option in ("nope-none", "nope-every-2nd", "rope-theta-1e6"):
        other = SmolLM3(cfg.replace(**ABLATION_OPTIONS[option])).eval()
        other.load_state_dict(base.state_dict())  # same weights, other positions
        with torch.no_grad():
            assert (other(ids).logits - base(ids).logits).abs().max() > 1e-3, option


def test_what_transformers_cannot_express_is_refused_at_export(tiny_cfg, tmp_path):
    with pytest.raises(ValueError, match=r"qk_norm=True has no transformers SmolLM3 equivalent"):
        export_hf(SmolLM3(tiny_cfg.replace(qk_norm=True)), tmp_path / "hf")
    assert not (tmp_path / "hf").exists() and not (tmp_path / "hf.tmp").exists()


# --- what our model cannot hold is refused, never dropped ------------------------------------

SMALL_HF = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    no_rope_layer_interval=4,
    pad_token_id=None,
    bos_token_id=None,
    eos_token_id=None,
)
# Each feature, the words the refusal names it by. Sliding windows act on NoPE layers only
# (transformers' SmolLM3), so the window is shorter than the test sequence.
UNSUPPORTED = {
    "attention_bias": ({"attention_bias": True}, "attention_bias=True"),
    "mlp_bias": ({"mlp_bias": True}, "mlp_bias=True"),
    "gelu": ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    "sliding_window": ({"use_sliding_window": True, "sliding_window": 4}, "use_sliding_window=True"),
    # YaRN imports (test_yarn_* below); linear interpolation and DeepSeek's mscale YaRN do not.
    "linear_rope": ({"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}}, "rope scaling"),
    "yarn_mscale": (
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 2.0,
                "original_max_position_embeddings": 64,
                "mscale": 0.707,
                "mscale_all_dim": 0.707,
            }
        },
        "mscale",
    ),
    "head_dim": ({"head_dim": 16}, "head_dim=16"),
}


def _hf_with(tmp_path, **overrides):
    torch.manual_seed(3)
    hf = SmolLM3ForCausalLM(SmolLM3Config(**{**SMALL_HF, **overrides})).eval()
    for p in hf.parameters():  # a trained-like spread, so biases and windows show in the logits
        p.data.normal_(0, 0.3)
    folder = tmp_path / "hf"
    hf.save_pretrained(folder)
    return hf, folder


@pytest.mark.parametrize("feature", sorted(UNSUPPORTED))
def test_import_refuses_each_feature_our_model_lacks_by_name(tmp_path, feature):
    from evals.lm import smollm3_view

    overrides, words = UNSUPPORTED[feature]
    hf, folder = _hf_with(tmp_path, **overrides)
    with pytest.raises(ValueError, match="cannot express") as err:
        import_hf(folder)
    assert words in str(err.value) and str(folder) in str(err.value)
    with pytest.raises(ValueError, match="cannot express"):
        import_hf(hf)  # a loaded model as well
    assert smollm3_view(hf) is None  # the evaluator keeps lm-eval's own scoring: the same check
    if feature in ("attention_bias", "mlp_bias", "gelu", "sliding_window"):
        # Not a formality: the features-dropped model would give other logits.
        plain = {k: v for k, v in hf.config.to_dict().items() if k in SMALL_HF}
        dropped = SmolLM3ForCausalLM(SmolLM3Config(**plain)).eval()
        dropped.load_state_dict(hf.state_dict(), strict=False)
        ids = torch.randint(0, 96, (1, 12))
        with torch.no_grad():
            assert (hf(ids).logits - dropped(ids).logits).abs().max() > 1e-2


def test_one_refusal_names_every_unsupported_feature_and_unmapped_tensors(tmp_path):
    _, folder = _hf_with(tmp_path, attention_bias=True, mlp_bias=True, hidden_act="gelu")
    with pytest.raises(ValueError) as err:
        import_hf(folder)
    assert all(w in str(err.value) for w in ("attention_bias=True", "mlp_bias=True", "hidden_act='gelu'"))
    # Biases whose config flag is off (a hand-edited config.json): the tensors are refused too.
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(
        json.dumps({**config, "attention_bias": False, "mlp_bias": False, "hidden_act": "silu"})
    )
    with pytest.raises(ValueError, match=r"no place for .*q_proj\.bias"):
        import_hf(folder)


def test_another_architecture_is_refused_by_its_model_type(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = LlamaForCausalLM(
        LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    )
    llama.save_pretrained(tmp_path / "llama")
    with pytest.raises(ValueError, match="model_type 'llama'"):
        import_hf(tmp_path / "llama")


# --- YaRN (docs/model.md "Long context: YaRN") -------------------------------------------------


def test_yarn_tables_are_transformers_own_bit_for_bit():
    """At SmolLM3's published shape and serving setting (theta 5M, 64k trained, factor 2) and on
    a small head: the same inverse frequencies and cos/sin scale as `_compute_yarn_parameters`."""
    from transformers.modeling_rope_utils import _compute_yarn_parameters

    from model.config import ModelConfig
    from model.rope import rope_tables

    shapes = [
        ModelConfig.smollm3_3b(rope_theta=5_000_000.0, max_seq_len=65536).with_yarn(2.0),
        ModelConfig.tiny(vocab_size=128, hidden_size=64, num_heads=4, rope_theta=10_000.0).with_yarn(4.0, 100),
        ModelConfig.tiny(hidden_size=64, num_heads=4).with_yarn(2.0, beta_fast=8, beta_slow=2, attention_factor=0.9),
    ]
    for cfg in shapes:
        hf_cfg = to_hf_config(cfg)
        theirs, their_scale = _compute_yarn_parameters(hf_cfg)
        ours, our_scale = rope_tables(cfg)
        assert torch.equal(ours, theirs) and our_scale == their_scale, cfg
        plain, _ = rope_tables(cfg.replace(rope_scaling=None))
        assert not torch.equal(ours, plain)  # some dimensions really are interpolated


@pytest.fixture
def yarn_pair(trained_like):
    """The trained-like model read at twice its trained length with YaRN, same weights."""
    cfg = trained_like.config.with_yarn(2.0)
    yarn = SmolLM3(cfg).eval()
    yarn.load_state_dict(trained_like.state_dict())
    return trained_like, yarn


def test_yarn_export_has_exact_transformers_parity_at_twice_the_trained_length(yarn_pair, tmp_path):
    plain, yarn = yarn_pair
    trained = plain.config.max_seq_len
    out = export_hf(yarn, tmp_path / "hf", eos_token_id=0)
    config = json.loads((out / "config.json").read_text())
    assert config["rope_parameters"] == {
        "rope_type": "yarn",
        "rope_theta": 10_000.0,
        "factor": 2.0,
        "original_max_position_embeddings": trained,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": True,
    }
    assert config["max_position_embeddings"] == 2 * trained
    hf = SmolLM3ForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, plain.config.vocab_size, (2, 2 * trained))
    docs = torch.tensor([[0] * trained + [1] * trained, [0] * (2 * trained)])
    with torch.no_grad():
        ours, theirs = yarn(ids).logits, hf(ids).logits
        assert (ours - theirs).abs().max().item() == 0.0  # CPU fp32, same kernels: exactly equal
        # Not vacuous: without YaRN the same weights give other logits past the trained length.
        assert (plain(ids).logits - ours).abs().max() > 1e-2
        # Positions restart per document under YaRN too: a second document equals itself alone.
        packed = yarn(ids[:1], doc_ids=docs[:1]).logits[0, trained:]
        alone = yarn(ids[:1, trained:]).logits[0]
        torch.testing.assert_close(packed, alone, atol=1e-5, rtol=0)
    back = import_hf(out)
    assert back.config == yarn.config and back.rope_scale == yarn.rope_scale


def test_the_model_cards_legacy_rope_scaling_loads_as_the_same_yarn(yarn_pair, tmp_path):
    """SmolLM3's card serves 128k by adding `"rope_scaling": {"factor": 2.0,
    "original_max_position_embeddings": 65536, "type": "yarn"}` to config.json: that form, on a
    plain export, gives the model our YaRN config computes (in transformers and in our import)."""
    from evals.lm import smollm3_view

    plain, yarn = yarn_pair
    trained = plain.config.max_seq_len
    out = export_hf(plain, tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config |= {
        "rope_theta": rope["rope_theta"],
        "max_position_embeddings": 2 * trained,
        "rope_scaling": {"factor": 2.0, "original_max_position_embeddings": trained, "type": "yarn"},
    }
    (out / "config.json").write_text(json.dumps(config))
    ids = torch.randint(0, plain.config.vocab_size, (1, 2 * trained))
    hf = SmolLM3ForCausalLM.from_pretrained(out).eval()
    imported = import_hf(out)
    assert imported.config == yarn.config
    view = smollm3_view(hf)  # what the evaluator scores with
    with torch.no_grad():
        want = yarn(ids).logits
        assert (hf(ids).logits - want).abs().max().item() == 0.0
        assert (imported(ids).logits - want).abs().max().item() == 0.0
        assert (view(ids).logits - want).abs().max().item() == 0.0
