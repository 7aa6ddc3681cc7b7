"""ModelConfig: the shape of the SmolLM3-style decoder, with named presets.

A frozen dataclass validated on construction. Presets are named constructors
(`ModelConfig.tiny()`, `ModelConfig.smollm3_3b()`, `ModelConfig.ablation_1b()`) and
`ModelConfig.from_preset(name, **overrides)` is the one string-keyed entry point used by
training specs. `num_parameters()` counts parameters analytically, without allocating.

`RopeScaling` is YaRN (Peng et al. 2023, arXiv:2309.00071) as transformers computes it
(`modeling_rope_utils._compute_yarn_parameters`): a model trained at `original_max_position_embeddings`
read at `factor` x that length. SmolLM3 is trained without it and served at 128k with factor 2
over its 64k stage (docs/model.md "Long context: YaRN"); here it is set for evaluation and export,
never for training.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RopeScaling:
    """YaRN: RoPE frequencies interpolated by `factor` where a dimension turns fewer than
    `beta_slow` times over the trained length, kept where it turns more than `beta_fast` times,
    a linear ramp between; cos and sin scaled by `attention_factor` (model/rope.py)."""

    factor: float  # served length / trained length (SmolLM3: 2.0, 64k -> 128k)
    original_max_position_embeddings: int  # the length the model was trained at (SmolLM3: 65536)
    beta_fast: float = 32.0  # rotations over the trained length above which a dimension is kept
    beta_slow: float = 1.0  # rotations below which a dimension is fully interpolated
    attention_factor: float | None = None  # cos/sin scale; None = 0.1 ln(factor) + 1 (the paper's)
    truncate: bool = True  # round the ramp's ends to whole dimensions (transformers' default)

    def __post_init__(self) -> None:
        for name in ("factor", "beta_fast", "beta_slow", "attention_factor"):
            value = getattr(self, name)
            if value is None and name == "attention_factor":
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise ValueError(f"RopeScaling.{name} must be a finite number, got {value!r}")
        for name in ("factor", "beta_fast", "beta_slow", "attention_factor"):  # one JSON form: 2 -> 2.0
            if getattr(self, name) is not None:
                object.__setattr__(self, name, float(getattr(self, name)))
        if self.factor < 1:
            raise ValueError(f"RopeScaling.factor must be >= 1 (a longer context), got {self.factor!r}")
        original = self.original_max_position_embeddings
        if not isinstance(original, int) or isinstance(original, bool) or original <= 0:
            raise ValueError(f"RopeScaling.original_max_position_embeddings must be a positive int, got {original!r}")
        if self.beta_fast < self.beta_slow:
            raise ValueError(f"RopeScaling.beta_fast={self.beta_fast} must be >= beta_slow={self.beta_slow}")
        if self.attention_factor is not None and self.attention_factor <= 0:
            raise ValueError(f"RopeScaling.attention_factor must be > 0, got {self.attention_factor!r}")

    @property
    def max_positions(self) -> int:
        """The length the scaling serves: factor x the trained length."""
        return int(self.factor * self.original_max_position_embeddings)

    @property
    def cos_sin_scale(self) -> float:
        """What cos and sin are multiplied by (transformers' `attention_scaling`)."""
        if self.attention_factor is not None:
            return float(self.attention_factor)
        return 1.0 if self.factor <= 1 else 0.1 * math.log(self.factor) + 1.0


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 4096  # tokenizer size; ours is trained, so callers pass the real one
    hidden_size: int = 256  # residual stream width (d_model)
    intermediate_size: int = 768  # SwiGLU inner width (gate and up projections)
    num_layers: int = 4  # decoder blocks
    num_heads: int = 4  # query heads; head_dim = hidden_size // num_heads
    num_kv_heads: int = (
        2  # GQA: key/value heads, each shared by num_heads // num_kv_heads queries (= num_heads: MHA, 1: MQA)
    )
    max_seq_len: int = 4096  # longest sequence the RoPE tables are sized for (grows on demand)
    rope_theta: float = 50_000.0  # RoPE base; raised for context extension (2M, 5M in SmolLM3)
    no_rope_interval: int = 4  # every Nth layer (1-indexed) skips RoPE (NoPE); 0 disables NoPE
    rms_norm_eps: float = 1e-6  # RMSNorm epsilon, as SmolLM3
    tie_embeddings: bool = True  # output head reuses the token embedding (saves V*H params)
    qk_norm: bool = False  # RMSNorm on per-head queries and keys (off in SmolLM3; not HF-exportable)
    z_loss: float = 0.0  # coefficient of the logsumexp^2 auxiliary loss (0 = off, as SmolLM3)
    init_std: float = 0.02  # std of the normal init of every linear and embedding weight
    # YaRN for reading past the trained length (evaluation, export); None = plain RoPE, as trained
    rope_scaling: RopeScaling | None = None

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, dict):  # from JSON (a checkpoint's config, a recipe)
            unknown = set(self.rope_scaling) - {f.name for f in dataclasses.fields(RopeScaling)}
            if unknown:
                raise ValueError(f"unknown ModelConfig.rope_scaling fields {sorted(unknown)}")
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(f"ModelConfig.rope_scaling must be a RopeScaling or None, got {self.rope_scaling!r}")
        positive = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "max_seq_len",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"ModelConfig.hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads={self.num_heads} is not divisible by "
                f"num_kv_heads={self.num_kv_heads} (GQA groups must be whole)"
            )
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig head_dim={self.head_dim} must be even for RoPE")
        if not isinstance(self.no_rope_interval, int) or self.no_rope_interval < 0:
            raise ValueError(f"ModelConfig.no_rope_interval must be an int >= 0, got {self.no_rope_interval!r}")
        for name in ("rope_theta", "rms_norm_eps", "init_std", "z_loss"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise ValueError(f"ModelConfig.{name} must be a finite number, got {value!r}")
        for name in ("rope_theta", "rms_norm_eps", "init_std"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ModelConfig.{name} must be > 0, got {getattr(self, name)!r}")
        if self.z_loss < 0:
            raise ValueError(f"ModelConfig.z_loss must be >= 0, got {self.z_loss!r}")

    # ---- derived -------------------------------------------------------------------------

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def uses_rope(self, layer: int) -> bool:
        """True when `layer` (0-indexed) applies RoPE; interval 4 makes 3, 7, 11, ... NoPE."""
        if self.no_rope_interval == 0:
            return True
        return (layer + 1) % self.no_rope_interval != 0

    def num_parameters(self) -> int:
        """Exact parameter count of `SmolLM3` built from this config (tied head counted once)."""
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        attn = h * h + 2 * h * kv + h * h  # q, k, v, o; no biases
        if self.qk_norm:
            attn += 2 * self.head_dim
        mlp = 3 * h * self.intermediate_size  # gate, up, down
        per_layer = attn + mlp + 2 * h  # two RMSNorm weights
        embed = self.vocab_size * h
        head = 0 if self.tie_embeddings else self.vocab_size * h
        return embed + self.num_layers * per_layer + h + head  # + final norm

    def to_dict(self) -> dict[str, Any]:
        """Its fields as JSON values; `rope_scaling` only when set (configs written before it
        existed read back equal)."""
        data = dataclasses.asdict(self)
        if self.rope_scaling is None:
            del data["rope_scaling"]
        return data

    def with_yarn(self, factor: float, trained_len: int | None = None, **options: Any) -> ModelConfig:
        """This model read at `factor` x `trained_len` (default: its max_seq_len) with YaRN: the
        scaling set and max_seq_len raised to the served length."""
        scaling = RopeScaling(factor, trained_len or self.max_seq_len, **options)
        return self.replace(rope_scaling=scaling, max_seq_len=max(self.max_seq_len, scaling.max_positions))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown ModelConfig fields {sorted(unknown)}")
        return cls(**data)

    def replace(self, **overrides: Any) -> ModelConfig:
        unknown = set(overrides) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ValueError(f"unknown ModelConfig override(s) {sorted(unknown)}")
        return dataclasses.replace(self, **overrides)

    # ---- presets ---------------------------------------------------------------------------

    @classmethod
    def tiny(cls, vocab_size: int = 4096, **overrides: Any) -> ModelConfig:
        """4,196,608 parameters at vocab 4096: trains at thousands of tokens/s on 2 CPU cores."""
        base = cls(
            vocab_size=vocab_size,
            hidden_size=256,
            intermediate_size=768,
            num_layers=4,
            num_heads=4,
            num_kv_heads=2,
            max_seq_len=1024,
        )
        return base.replace(**overrides)

    @classmethod
    def smollm3_3b(cls, **overrides: Any) -> ModelConfig:
        """The published SmolLM3-3B shape: 3,075,098,624 parameters."""
        base = cls(
            vocab_size=128_256,
            hidden_size=2048,
            intermediate_size=11008,
            num_layers=36,
            num_heads=16,
            num_kv_heads=4,
            max_seq_len=4096,
            rope_theta=50_000.0,
            no_rope_interval=4,
            rms_norm_eps=1e-6,
            tie_embeddings=True,
        )
        return base.replace(**overrides)

    @classmethod
    def ablation_1b(cls, **overrides: Any) -> ModelConfig:
        """The Smol playbook's 1B ablation model (Llama-3.2-1B shape, tied, NoPE every 4th)."""
        base = cls(
            vocab_size=128_256,
            hidden_size=2048,
            intermediate_size=8192,
            num_layers=16,
            num_heads=32,
            num_kv_heads=8,
            max_seq_len=4096,
            rope_theta=50_000.0,
            tie_embeddings=True,
        )
        return base.replace(**overrides)

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> ModelConfig:
        presets = {"tiny": cls.tiny, "smollm3_3b": cls.smollm3_3b, "ablation_1b": cls.ablation_1b}
        key = name.replace("-", "_")
        if key not in presets:
            raise ValueError(f"unknown model preset {name!r}; allowed presets: {', '.join(sorted(presets))}")
        return presets[key](**overrides)


def model_facts(model: str, overrides: dict[str, Any], vocab_size: int) -> dict[str, Any]:
    """The model's size and limits at the tokenizer's real vocabulary (the trainer's rule)."""
    cfg = ModelConfig.from_preset(model, **{**overrides, "vocab_size": vocab_size})
    return {
        "max_positions": cfg.max_seq_len,
        "tokenizer_vocab": vocab_size,
        "model_vocab": cfg.vocab_size,
        "params": cfg.num_parameters(),
    }
