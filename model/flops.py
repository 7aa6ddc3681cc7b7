"""FLOP accounting for throughput and MFU, and the peak MFU is measured against.

Training FLOPs per token follow the PaLM/Chinchilla convention: 6 x parameters (forward and
backward of every matmul, the tied output head included) plus 12 x layers x hidden x seq_len
for attention scores and values (full, not halved for causality).

The peak (`resolve_peak`), per device, in this order:
1. declared: the recipe's `training.peak_flops` (spec.peak_flops);
2. the datasheet: dense bf16 tensor-core FLOP/s of known accelerators (`DEVICE_PEAK_BF16`), for
   bf16 autocast on CUDA (the MFU convention of PaLM, torchtitan, nanotron);
3. a calibration preflight stored for this host (spec.peak_calibration: its fp32 matmul on CPU,
   bf16 matmul on an unknown GPU), measured once before training, not beside other work;
4. none: MFU is not reported, and the metrics say why.
There is no probe at training start: measured while an evaluation ran beside the trainer it read
low, and a stage reported MFU 149.9% (and 211.9% against a calibration taken on a busy machine).
The metrics carry the peak and its source (`mfu_peak_flops`, `mfu_peak_source`). A peak below
what training itself achieves is wrong by construction, so the trainer never reports MFU above 1:
it says the peak is wrong, with both rates, and records `mfu` null with `mfu_invalid` saying why
(trainers/pretrain.py `StepReport`).
"""

from __future__ import annotations

import re
import time

import torch

from model.config import ModelConfig
from model.spec import PeakCalibration

# Dense (not 2:4 sparse) bf16 tensor-core peak per device, from the vendors' datasheets. Matched
# on the CUDA device name in this order (the first pattern found wins: "H100 NVL" before "H100").
DEVICE_PEAK_BF16: tuple[tuple[str, float], ...] = (
    (r"\bGH200\b", 989e12),
    (r"\bH200 NVL\b", 835e12),
    (r"\bH200\b", 989e12),
    (r"\bH100 NVL\b", 835e12),
    (r"\bH100 PCIe\b", 756e12),
    (r"\bH100\b", 989e12),  # SXM (HBM3)
    (r"\bB200\b", 2250e12),
    (r"\bA100\b", 312e12),  # SXM and PCIe
    (r"\bL40S\b", 362e12),
    (r"\bL4\b", 121e12),
    (r"\bMI325X\b", 1307e12),
    (r"\bMI300X\b", 1307e12),
)


def training_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    return 6.0 * cfg.num_parameters() + 12.0 * cfg.num_layers * cfg.hidden_size * seq_len


def datasheet_peak(device_name: str) -> float | None:
    """Dense bf16 peak FLOP/s of a known accelerator name (torch.cuda.get_device_name), else None."""
    for pattern, flops in DEVICE_PEAK_BF16:
        if re.search(pattern, device_name):
            return flops
    return None


def resolve_peak(
    declared: float | None,
    calibration: PeakCalibration | None,
    *,
    device: str,
    bf16: bool,
    host: str,
    device_name: str = "",
    threads: int | None = None,
) -> tuple[float | None, str]:
    """(peak FLOP/s per device or CPU rank, where it comes from); (None, why) when unknown.

    `device` "cuda" or "cpu", `bf16` whether the forward runs under bf16 autocast, `host` this
    rank's host name, `threads` its CPU threads (a CPU calibration scales to them)."""
    if declared is not None:
        return declared, "declared (training.peak_flops)"
    dtype = "bfloat16" if bf16 else "float32"
    if device == "cuda" and bf16:
        peak = datasheet_peak(device_name)
        if peak is not None:
            return peak, f"datasheet: {device_name} dense bf16"
    if calibration is not None:
        if calibration.host != host:
            why = f"the calibration was measured on {calibration.host}, this rank runs on {host}"
        elif calibration.device != device or calibration.dtype != dtype:
            why = (
                f"the calibration is a {calibration.device} {calibration.dtype} matmul, this "
                f"stage trains in {dtype} on {device}"
            )
        else:
            peak, source = calibration.flops, calibration.source
            if device == "cpu" and calibration.threads and threads and threads != calibration.threads:
                # Linear in threads: an upper bound on the scaled rate, so MFU errs low, never high.
                peak *= threads / calibration.threads
                source += f", scaled from {calibration.threads} to {threads} threads"
            return peak, source
    else:
        why = "no preflight calibration for this host"
    name = f"{device_name} " if device_name else ""
    return None, (
        f"none: no datasheet peak for {name}{device} {dtype} and {why}; declare "
        "training.peak_flops or run preflight on this host"
    )


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
