"""Conversion between our `SmolLM3` and transformers' `SmolLM3ForCausalLM`.

`export_hf` writes a `save_pretrained` folder (safetensors, config.json, optional tokenizer) that
evaluation (lm-eval `hf`), TRL post-training and serving load with `from_pretrained`;
`import_hf` reads such a folder back into our model. The mapping is a pure renaming (no
arithmetic), so a round trip reproduces every tensor bit for bit.

Our NoPE interval becomes transformers' per-layer `no_rope_layers` list, where 1 means RoPE and
0 means NoPE; the tied head is written as `lm_head.weight` = the embedding.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from model.config import ModelConfig
from model.model import SmolLM3


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
        rope_parameters={"rope_type": "default", "rope_theta": float(cfg.rope_theta)},
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


def from_hf_config(hf_cfg) -> ModelConfig:
    rope = hf_cfg.rope_parameters or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"rope_parameters {rope} are not plain RoPE; only 'default' imports")
    head_dim = getattr(hf_cfg, "head_dim", None)
    if head_dim not in (None, hf_cfg.hidden_size // hf_cfg.num_attention_heads):
        raise ValueError(f"head_dim={head_dim} differs from hidden_size / num_attention_heads")
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
    names = _name_map(cfg)
    missing = [theirs for theirs in names.values() if theirs not in sd]
    if missing:
        raise KeyError(f"transformers state dict lacks {missing[:5]} (and {len(missing)} in all)")
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


def _copy_tokenizer(tokenizer_dir: str | Path, out_dir: Path) -> None:
    tokenizer_dir = Path(tokenizer_dir)
    if (tokenizer_dir / "tokenizer_config.json").exists():
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(str(out_dir))
    elif (tokenizer_dir / "tokenizer.json").exists():
        from transformers import PreTrainedTokenizerFast

        tok = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_dir / "tokenizer.json"))
        tok.save_pretrained(str(out_dir))
    else:
        raise FileNotFoundError(f"tokenizer_dir {tokenizer_dir} has neither tokenizer_config.json nor tokenizer.json")


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
    """Our model from a `SmolLM3ForCausalLM` folder (or a loaded `SmolLM3ForCausalLM`)."""
    from transformers import SmolLM3Config

    if isinstance(path, str | Path):
        from safetensors.torch import load_file

        folder = Path(path)
        if not (folder / "config.json").exists():
            raise FileNotFoundError(f"{folder} is not a save_pretrained folder (no config.json)")
        hf_cfg = SmolLM3Config.from_pretrained(str(folder))
        sd: dict[str, torch.Tensor] = {}
        for shard in sorted(folder.glob("*.safetensors")):
            sd |= load_file(str(shard))
        if not sd:
            raise FileNotFoundError(f"{folder} holds no .safetensors weights")
    else:
        hf_cfg, sd = path.config, path.state_dict()
    cfg = from_hf_config(hf_cfg)
    if cfg.tie_embeddings and "lm_head.weight" not in sd:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    model = SmolLM3(cfg)
    ours = from_hf_state_dict(sd, cfg)
    model.load_state_dict({k: v.float() for k, v in ours.items()}, strict=True)
    return model.eval()
