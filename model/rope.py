"""Rotary position embeddings (RoPE), in the layout of transformers' Llama/SmolLM3.

The head dimension is split in two halves that rotate together (`rotate_half`), not interleaved
pairs, so weights convert to and from `SmolLM3ForCausalLM` without permuting q/k projections.
Positions are passed explicitly because intra-document masking restarts them at every document.

With YaRN (`ModelConfig.rope_scaling`, model/config.py `RopeScaling`) the inverse frequencies
and the cos/sin scale are transformers' `_compute_yarn_parameters`, operation for operation, so
our model and the exported `SmolLM3ForCausalLM` compute the same tables bit for bit.
"""

from __future__ import annotations

import math

import torch

from model.config import ModelConfig, RopeScaling


def inv_frequencies(head_dim: int, theta: float) -> torch.Tensor:
    """(head_dim/2,) float32 inverse frequencies, computed exactly as transformers does."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def yarn_inv_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """(head_dim/2,) float32 YaRN inverse frequencies: each dimension interpolated (divided by
    `factor`) or kept, by how many turns it makes over the trained length, with a linear ramp
    between `beta_slow` and `beta_fast` turns (transformers' `_compute_yarn_parameters`)."""
    original = scaling.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).to(dtype=torch.float) / head_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (scaling.factor * pos_freqs)
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1: the dimension keeps its trained frequency, 0: interpolated
    return interpolation * (1 - keep) + extrapolation * keep


def rope_tables(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """The model's inverse frequencies and the scale of its cos/sin tables (1.0 without YaRN)."""
    if cfg.rope_scaling is None:
        return inv_frequencies(cfg.head_dim, cfg.rope_theta), 1.0
    scaling = cfg.rope_scaling
    return yarn_inv_frequencies(cfg.head_dim, cfg.rope_theta, scaling), scaling.cos_sin_scale


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables for `positions` (B, T) -> two (B, 1, T, head_dim) tensors, times `scale`
    (YaRN's attention factor; 1.0 leaves them as they are)."""
    freqs = positions[..., None].float() * inv_freq.to(positions.device)  # (B, T, hd/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (B, T, hd)
    cos, sin = emb.cos(), emb.sin()
    if scale != 1.0:  # in float32 before the cast, as transformers
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype)[:, None], sin.to(dtype)[:, None]  # (B, 1, T, hd)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate queries or keys x (B, nh, T, hd) by the tables from `rope_cos_sin`."""
    return x * cos + rotate_half(x) * sin


def positions_from_doc_ids(doc_ids: torch.Tensor) -> torch.Tensor:
    """Position of each token inside its document: (B, T) doc ids -> (B, T) int64 positions.

    Documents are contiguous runs of equal ids, so a position is the distance to the start of
    the run. Example: doc ids [0, 0, 0, 1, 1, 2] -> positions [0, 1, 2, 0, 1, 0].
    """
    B, T = doc_ids.shape
    idx = torch.arange(T, device=doc_ids.device).expand(B, T)  # (B, T)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    run_start = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values  # (B, T)
    return idx - run_start
