"""Conversion between our `SmolLM3` and transformers' `SmolLM3ForCausalLM`.

`export_hf` writes a `save_pretrained` folder (safetensors, config.json, optional tokenizer) that
evaluation (lm-eval `hf`), TRL post-training and serving load with `from_pretrained`;
`import_hf` reads such a folder back into our model. The mapping is a pure renaming (no
arithmetic), so a round trip reproduces every tensor bit for bit.

Our NoPE interval becomes transformers' per-layer `no_rope_layers` list, where 1 means RoPE and
0 means NoPE; the tied head is written as `lm_head.weight` = the embedding. YaRN
(`ModelConfig.rope_scaling`) is `rope_parameters` `{"rope_type": "yarn", ...}`, which transformers
also reads in the legacy form of SmolLM3's model card (`"rope_scaling": {"type": "yarn", ...}`).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from model.config import ModelConfig, RopeScaling
from model.model import SmolLM3

# The YaRN keys of transformers' `rope_parameters` our RopeScaling holds (mscale and
# mscale_all_dim, DeepSeek's variant of the attention factor, it does not).
_YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor", "truncate")


def rope_parameters(cfg: ModelConfig) -> dict:
    """transformers' `rope_parameters` of our config: plain RoPE, or YaRN with every setting
    written out (no default left to the reader's version)."""
    if cfg.rope_scaling is None:
        return {"rope_type": "default", "rope_theta": float(cfg.rope_theta)}
    yarn = {k: v for k in _YARN_KEYS if (v := getattr(cfg.rope_scaling, k)) is not None}
    return {"rope_type": "yarn", "rope_theta": float(cfg.rope_theta), **yarn}


def _rope_scaling(rope: dict) -> RopeScaling | None:
    """Our RopeScaling of transformers' `rope_parameters` (None: plain RoPE)."""
    if rope.get("rope_type", "default") == "default":
        return None
    options = {k: rope[k] for k in _YARN_KEYS[2:] if rope.get(k) is not None}
    return RopeScaling(float(rope["factor"]), int(rope["original_max_position_embeddings"]), **options)


def to_hf_config(cfg: ModelConfig, eos_token_id: int | None = None):
    from transformers import SmolLM3Config

    if cfg.qk_norm:
        raise ValueError(
            "ModelConfig.qk_norm=True has no transformers SmolLM3 equivalent; export a model trained with qk_norm=False"
        )
    # z_loss is not exported: it only shapes training, the network itself is the same.
    return SmolLM3Config(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_parameters=rope_parameters(cfg),
        no_rope_layers=[int(cfg.uses_rope(i)) for i in range(cfg.num_layers)],
        no_rope_layer_interval=cfg.no_rope_interval or cfg.num_layers + 1,
        tie_word_embeddings=cfg.tie_embeddings,
        initializer_range=cfg.init_std,
        attention_bias=False,
        mlp_bias=False,
        # Our embedding has no padding row; a pad id inside the vocab would freeze a row in HF.
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=eos_token_id,
    )


def _nope_interval(no_rope_layers: list[int]) -> int:
    """The interval N whose pattern (every Nth layer NoPE) equals `no_rope_layers`, 0 = none."""
    n = len(no_rope_layers)
    if all(no_rope_layers):
        return 0
    for interval in range(1, n + 1):
        if [int((i + 1) % interval != 0) for i in range(n)] == list(no_rope_layers):
            return interval
    raise ValueError(
        f"no_rope_layers={list(no_rope_layers)} is not 'NoPE every Nth layer'; "
        "ModelConfig.no_rope_interval cannot express it"
    )


def unsupported_features(hf_cfg) -> list[str]:
    """What a transformers config asks for that our SmolLM3 cannot compute, one phrase each
    (empty: the model imports exactly). The one check behind `import_hf`, `from_hf_config` (the
    `pin` step's base description) and the evaluator's `smollm3_view`: a model that fails it would
    load with those parts dropped and give other logits."""
    found = []
    model_type = getattr(hf_cfg, "model_type", None)
    if model_type != "smollm3":
        found.append(f"model_type {model_type!r} (only 'smollm3' maps onto our decoder)")
    if getattr(hf_cfg, "attention_bias", False):
        found.append("attention_bias=True (q/k/v/o projection biases; ours have none)")
    if getattr(hf_cfg, "mlp_bias", False):
        found.append("mlp_bias=True (gate/up/down projection biases; ours have none)")
    act = getattr(hf_cfg, "hidden_act", "silu")
    if act != "silu":
        found.append(f"hidden_act={act!r} (our MLP is SwiGLU: silu)")
    sliding = [t for t in getattr(hf_cfg, "layer_types", None) or [] if t != "full_attention"]
    if getattr(hf_cfg, "use_sliding_window", False) or sliding:
        found.append(
            f"use_sliding_window=True (sliding_window={getattr(hf_cfg, 'sliding_window', None)}, "
            f"{len(sliding)} layer(s) {sorted(set(sliding)) or ['full_attention']}; ours attend to the whole sequence)"
        )
    rope = getattr(hf_cfg, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", "default")
    if rope_type not in ("default", "yarn"):
        found.append(f"rope scaling {rope} (only plain RoPE and YaRN, rope_type 'default' or 'yarn', import)")
    elif rope_type == "yarn" and (rope.get("mscale") or rope.get("mscale_all_dim") or rope.get("factor") is None):
        found.append(f"rope scaling {rope} (YaRN with mscale/mscale_all_dim or without a factor; ours has neither)")
    heads, hidden = getattr(hf_cfg, "num_attention_heads", 0), getattr(hf_cfg, "hidden_size", 0)
    head_dim = getattr(hf_cfg, "head_dim", None)
    if head_dim is not None and heads and head_dim != hidden // heads:
        found.append(f"head_dim={head_dim} (ours is hidden_size / num_attention_heads = {hidden // heads})")
    return found


def check_supported(hf_cfg, what: str = "this model") -> None:
    """Raise naming every feature of `hf_cfg` our SmolLM3 cannot hold (see `unsupported_features`)."""
    found = unsupported_features(hf_cfg)
    if found:
        raise ValueError(
            f"{what} uses what our SmolLM3 cannot express, so importing it would silently change its "
            f"outputs: {'; '.join(found)}. Train from a SmolLM3 export without these, or evaluate it "
            "with lm-eval's stock `hf` model"
        )


def from_hf_config(hf_cfg, what: str = "this model") -> ModelConfig:
    """Our config of a transformers SmolLM3 config; refuses (naming each) what ours cannot hold."""
    check_supported(hf_cfg, what)
    rope = hf_cfg.rope_parameters or {}
    return ModelConfig(
        vocab_size=hf_cfg.vocab_size,
        hidden_size=hf_cfg.hidden_size,
        intermediate_size=hf_cfg.intermediate_size,
        num_layers=hf_cfg.num_hidden_layers,
        num_heads=hf_cfg.num_attention_heads,
        num_kv_heads=hf_cfg.num_key_value_heads,
        max_seq_len=hf_cfg.max_position_embeddings,
        rope_theta=float(rope.get("rope_theta", 50_000.0)),
        no_rope_interval=_nope_interval(hf_cfg.no_rope_layers[: hf_cfg.num_hidden_layers]),
        rms_norm_eps=hf_cfg.rms_norm_eps,
        tie_embeddings=bool(hf_cfg.tie_word_embeddings),
        init_std=hf_cfg.initializer_range,
        rope_scaling=_rope_scaling(rope),
    )


# Our per-layer names -> transformers' per-layer names.
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.q.weight": "self_attn.q_proj.weight",
    "attn.k.weight": "self_attn.k_proj.weight",
    "attn.v.weight": "self_attn.v_proj.weight",
    "attn.o.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.gate.weight": "mlp.gate_proj.weight",
    "mlp.up.weight": "mlp.up_proj.weight",
    "mlp.down.weight": "mlp.down_proj.weight",
}


def _name_map(cfg: ModelConfig) -> dict[str, str]:
    names = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    for i in range(cfg.num_layers):
        for ours, theirs in _LAYER_NAMES.items():
            names[f"layers.{i}.{ours}"] = f"model.layers.{i}.{theirs}"
    if not cfg.tie_embeddings:
        names["lm_head.weight"] = "lm_head.weight"
    return names


def to_hf_state_dict(model: SmolLM3) -> dict[str, torch.Tensor]:
    sd = model.state_dict()
    out = {theirs: sd[ours].detach().contiguous() for ours, theirs in _name_map(model.config).items()}
    if model.config.tie_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def from_hf_state_dict(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our state dict from transformers' names; a tensor ours has no place for (a bias the config
    did not declare, another layer) is refused by name rather than dropped."""
    names = _name_map(cfg)
    missing = [theirs for theirs in names.values() if theirs not in sd]
    if missing:
        raise KeyError(f"transformers state dict lacks {missing[:5]} (and {len(missing)} in all)")
    known = set(names.values()) | {"lm_head.weight"}  # a tied head may be saved as well
    extra = sorted(k for k in sd if k not in known and not k.endswith("rotary_emb.inv_freq"))
    if extra:
        raise ValueError(
            f"transformers state dict holds {len(extra)} tensor(s) our SmolLM3 has no place for "
            f"(importing would drop them and change the outputs): {', '.join(extra[:6])}"
            + (" ..." if len(extra) > 6 else "")
        )
    return {ours: sd[theirs] for ours, theirs in names.items()}


def to_hf_model(model: SmolLM3, eos_token_id: int | None = None):
    from transformers import SmolLM3ForCausalLM

    hf_cfg = to_hf_config(model.config, eos_token_id)
    with torch.device("meta"):
        hf = SmolLM3ForCausalLM(hf_cfg)
    hf.load_state_dict(to_hf_state_dict(model), assign=True, strict=True)
    if model.config.tie_embeddings:
        hf.tie_weights()
    # Buffers (RoPE inverse frequencies) were on meta; rebuild them from the config.
    hf.model.rotary_emb = type(hf.model.rotary_emb)(config=hf_cfg)
    return hf.eval()


def read_with_rope_scaling(hf, scaling: RopeScaling):
    """A loaded `SmolLM3ForCausalLM` (in place) read with `scaling` from now on: its config's
    `rope_parameters` and `max_position_embeddings` as an export of that config would hold them,
    its rotary tables rebuilt on its device (the weights are untouched). Refuses a model our
    SmolLM3 cannot express, or one already scaled, naming what it holds."""
    cfg = from_hf_config(hf.config, "the model to read with rope scaling")
    if cfg.rope_scaling is not None:
        raise ValueError(f"the model already has rope scaling {cfg.rope_scaling}; export it without, then scale it")
    scaled = cfg.replace(rope_scaling=scaling, max_seq_len=max(cfg.max_seq_len, scaling.max_positions))
    hf.config.rope_parameters = rope_parameters(scaled)
    hf.config.max_position_embeddings = scaled.max_seq_len
    device = next(hf.parameters()).device
    hf.model.rotary_emb = type(hf.model.rotary_emb)(config=hf.config).to(device)
    return hf


def _copy_tokenizer(tokenizer_dir: str | Path, out_dir: Path) -> None:
    tokenizer_dir = Path(tokenizer_dir)
    if (tokenizer_dir / "tokenizer_config.json").exists():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        tokenizer.save_pretrained(str(out_dir))
        _stop_at_end_of_turn(tokenizer, out_dir)
    elif (tokenizer_dir / "tokenizer.json").exists():
        from transformers import PreTrainedTokenizerFast

        tok = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_dir / "tokenizer.json"))
        tok.save_pretrained(str(out_dir))
    else:
        raise FileNotFoundError(f"tokenizer_dir {tokenizer_dir} has neither tokenizer_config.json nor tokenizer.json")


def _stop_at_end_of_turn(tokenizer, out_dir: Path) -> None:
    """Generation stops at `<|im_end|>` (an assistant turn's end, in either reasoning mode) as well
    as at EOS, when the tokenizer has that token: `generation_config.eos_token_id` lists both."""
    from transformers import GenerationConfig

    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if end is None or end == tokenizer.unk_token_id or not (out_dir / "generation_config.json").exists():
        return
    generation = GenerationConfig.from_pretrained(str(out_dir))
    eos = generation.eos_token_id if isinstance(generation.eos_token_id, list) else [generation.eos_token_id]
    generation.eos_token_id = list(dict.fromkeys([end, *(i for i in eos if i is not None)]))
    generation.save_pretrained(str(out_dir))


def export_hf(
    model_or_ckpt: SmolLM3 | str | Path,
    out_dir: str | Path,
    tokenizer_dir: str | Path | None = None,
    eos_token_id: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write `out_dir` as a transformers `save_pretrained` folder and return its path.

    `model_or_ckpt` is our model, a checkpoint folder `step_XXXXXXXX/`, or a run folder (its
    newest complete checkpoint is used).
    """
    if isinstance(model_or_ckpt, SmolLM3):
        model = model_or_ckpt
    else:
        from model.checkpoint import load_model

        model = load_model(model_or_ckpt)
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    hf = to_hf_model(model, eos_token_id).to(dtype)
    hf.save_pretrained(str(tmp), safe_serialization=True)
    if tokenizer_dir is not None:
        _copy_tokenizer(tokenizer_dir, tmp)
    # Publish by rename so a reader never sees a half-written export.
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    return out_dir


def import_hf(path: str | Path) -> SmolLM3:
    """Our model from a `SmolLM3ForCausalLM` folder (or a loaded `SmolLM3ForCausalLM`); a model
    using what ours cannot compute (biases, another activation, sliding windows, rope scaling
    other than YaRN, an explicit head_dim, unmapped tensors) is refused, naming each (`unsupported_features`)."""
    if isinstance(path, str | Path):
        from safetensors.torch import load_file
        from transformers import AutoConfig

        folder = Path(path)
        if not (folder / "config.json").exists():
            raise FileNotFoundError(f"{folder} is not a save_pretrained folder (no config.json)")
        hf_cfg = AutoConfig.from_pretrained(str(folder))  # its own model_type, checked below
        sd: dict[str, torch.Tensor] = {}
        for shard in sorted(folder.glob("*.safetensors")):
            sd |= load_file(str(shard))
        if not sd:
            raise FileNotFoundError(f"{folder} holds no .safetensors weights")
    else:
        hf_cfg, sd = path.config, path.state_dict()
    cfg = from_hf_config(hf_cfg, f"HF model {path}" if isinstance(path, str | Path) else "this HF model")
    if cfg.tie_embeddings and "lm_head.weight" not in sd:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    model = SmolLM3(cfg)
    ours = from_hf_state_dict(sd, cfg)
    model.load_state_dict({k: v.float() for k, v in ours.items()}, strict=True)
    return model.eval()
