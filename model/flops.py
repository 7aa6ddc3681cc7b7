"""FLOP accounting for throughput and MFU.

Training FLOPs per token follow the PaLM/Chinchilla convention: 6 x parameters (forward and
backward of every matmul, the tied output head included) plus 12 x layers x hidden x seq_len
for attention scores and values (full, not halved for causality). The peak is either declared
(spec.peak_flops) or measured here with a large matmul: on CPU that is the fp32 matmul rate of
this machine, not a datasheet number, and the metrics say which one was used.
"""

from __future__ import annotations

import time

import torch

from model.config import ModelConfig


def training_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    return 6.0 * cfg.num_parameters() + 12.0 * cfg.num_layers * cfg.hidden_size * seq_len


def measure_matmul_flops(
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    size: int = 1024,
    seconds: float = 0.5,
) -> float:
    """Best sustained FLOP/s of size x size matmuls on `device` in `dtype`.

    Timed in short bursts and the best burst kept: on a shared machine the mean measures the
    neighbours' load, the best burst is the closest estimate of what the hardware can do.
    """
    device = torch.device(device)
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(2):  # warm-up: thread pools, cuBLAS handles
        a @ b
    sync()
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        for _ in range(4):
            a @ b
        sync()
        best = max(best, 4 * 2.0 * size**3 / (time.perf_counter() - start))
    return best
