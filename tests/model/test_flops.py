"""MFU's peak (model/flops.py): datasheet values by device name, and the order of the sources."""

from __future__ import annotations

import pytest

from model.flops import datasheet_peak, resolve_peak
from model.spec import PeakCalibration


@pytest.mark.parametrize(
    "name, flops",
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", 835e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA H200 NVL", 835e12),
        ("NVIDIA GH200 480GB", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A100 80GB PCIe", 312e12),
        ("NVIDIA L40S", 362e12),
        ("NVIDIA L4", 121e12),
        ("NVIDIA B200", 2250e12),
        ("AMD Instinct MI300X", 1307e12),
        ("NVIDIA GeForce RTX 4090", None),
        ("NVIDIA L40", None),  # not L4, not L40S
    ],
)
def test_datasheet_peaks_by_device_name(name, flops):
    assert datasheet_peak(name) == flops


CPU = PeakCalibration(
    host="node-1", device="cpu", dtype="float32", flops=4e10, threads=2, source="preflight abc on node-1: cpu_matmul"
)
GPU = PeakCalibration(host="node-1", device="cuda", dtype="bfloat16", flops=7e14, source="preflight gpu_matmul")


def test_declared_beats_datasheet_beats_calibration():
    kw = {"device": "cuda", "bf16": True, "host": "node-1", "device_name": "NVIDIA H100 80GB HBM3"}
    assert resolve_peak(5e14, GPU, **kw) == (5e14, "declared (training.peak_flops)")
    assert resolve_peak(None, GPU, **kw) == (989e12, "datasheet: NVIDIA H100 80GB HBM3 dense bf16")
    # An accelerator without a datasheet value: this host's preflight measurement.
    assert resolve_peak(None, GPU, **{**kw, "device_name": "NVIDIA RTX 6000 Ada"}) == (7e14, GPU.source)


def test_cpu_calibration_scales_to_the_ranks_threads_and_must_match_host_and_precision():
    kw = {"device": "cpu", "bf16": False, "host": "node-1"}
    assert resolve_peak(None, CPU, **kw, threads=2) == (4e10, CPU.source)
    peak, source = resolve_peak(None, CPU, **kw, threads=4)
    assert peak == 8e10 and source.endswith("scaled from 2 to 4 threads")
    peak, source = resolve_peak(None, CPU, **{**kw, "host": "node-2"}, threads=2)
    assert peak is None and "measured on node-1, this rank runs on node-2" in source
    peak, source = resolve_peak(None, CPU, **{**kw, "bf16": True}, threads=2)
    assert peak is None and "cpu float32 matmul, this stage trains in bfloat16" in source
    # A datasheet peak is bf16 tensor-core: an fp32 stage on that GPU has none.
    peak, source = resolve_peak(None, None, device="cuda", bf16=False, host="node-1", device_name="NVIDIA H100")
    assert peak is None and source.startswith("none: no datasheet peak for NVIDIA H100 cuda float32")
