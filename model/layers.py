"""Small building blocks of the decoder: RMSNorm and the SwiGLU feed-forward.

RMSNorm computes in float32 and casts back, like transformers' SmolLM3RMSNorm, so logits agree
with the HF model to float rounding. SwiGLU fuses the gate and up projections into one matmul
(one larger GEMM is faster than two on CPU and GPU); HF conversion splits it again.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.inner = inner
        self.gate_up = nn.Linear(hidden, 2 * inner, bias=False)  # rows [gate; up]
        self.down = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split(self.inner, dim=-1)  # (B, T, I) each
        return self.down(F.silu(gate) * up)  # (B, T, H)
