"""Rotary position embeddings (RoPE), in the layout of transformers' Llama/SmolLM3.

The head dimension is split in two halves that rotate together (`rotate_half`), not interleaved
pairs, so weights convert to and from `SmolLM3ForCausalLM` without permuting q/k projections.
Positions are passed explicitly because intra-document masking restarts them at every document.
"""

from __future__ import annotations

import torch


def inv_frequencies(head_dim: int, theta: float) -> torch.Tensor:
    """(head_dim/2,) float32 inverse frequencies, computed exactly as transformers does."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables for `positions` (B, T) -> two (B, 1, T, head_dim) tensors."""
    freqs = positions[..., None].float() * inv_freq.to(positions.device)  # (B, T, hd/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (B, T, hd)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]  # (B, 1, T, hd)


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
