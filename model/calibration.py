"""The MFU peaks a preflight measured on a host: its report's `calibration`, and the newest one a
finished preflight of a workspace holds for a host and device.

The preflight step (tasks/preflight.py) writes them into `preflight.json` (the fp32 `cpu_matmul`
at the preflight's threads, the bf16 `gpu_matmul` of the slowest GPU); the pretrain step reads
`host_calibration` into the trainer's operational `peak_calibration`, the MFU peak where no
datasheet value applies (model/flops.py).
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

from infra.preflight.core import CheckResult, PreflightConfig, metric_of
from infra.preflight.outcome import REPORT_JSON
from model.spec import PeakCalibration
from pipeline.artifact import read_marker


def calibrations(results: list[CheckResult], config: PreflightConfig, host: str, folder: str) -> list[PeakCalibration]:
    """The MFU peaks this preflight measured: `cpu_matmul` (fp32, at this process's threads) and
    `gpu_matmul` (bf16, the slowest GPU: it paces every synchronous step)."""
    import torch

    out = []
    cpu = metric_of(results, "cpu_matmul")
    if cpu:
        threads = torch.get_num_threads()
        out.append(
            PeakCalibration(
                host=host,
                device="cpu",
                dtype="float32",
                flops=cpu * 1e9,
                threads=threads,
                source=(
                    f"preflight {folder} on {host}: cpu_matmul fp32 {config.cpu_matmul_size}^2, "
                    f"best burst of 3 rounds, {threads} thread{'s' if threads > 1 else ''}"
                ),
            )
        )
    gpu = metric_of(results, "gpu_matmul")
    if gpu:
        out.append(
            PeakCalibration(
                host=host,
                device="cuda",
                dtype="bfloat16",
                flops=gpu * 1e12,
                source=f"preflight {folder} on {host}: gpu_matmul bf16 {config.matmul_size}^2, slowest GPU",
            )
        )
    return out


def host_calibration(workspace: Path, device: str, host: str | None = None) -> PeakCalibration | None:
    """The newest calibration for `device` ("cpu"/"cuda") measured on `host` (default: this one)
    by a finished preflight in `workspace`; None when there is none."""
    host = host or socket.gethostname()
    best: tuple[float, PeakCalibration] | None = None
    for report in sorted(Path(workspace, "preflight").glob(f"*/{REPORT_JSON}")):
        if read_marker(report.parent) is None:
            continue  # a failed or unfinished preflight measured nothing it stands behind
        try:
            data = json.loads(report.read_text(encoding="utf-8"))
            found = [PeakCalibration(**c) for c in data.get("calibration", [])]
        except (OSError, ValueError, TypeError):
            continue
        for c in found:
            if c.host == host and c.device == device:
                when = report.stat().st_mtime
                if best is None or when > best[0]:
                    best = (when, c)
    return best[1] if best else None
