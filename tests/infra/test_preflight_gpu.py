"""GPU preflight checks against a fake device layer: the pass/warn/fail logic without a GPU."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # the repo is not installed into the venv
    sys.path.insert(0, str(REPO))

from infra.preflight import (  # noqa: E402
    CommandOutput,
    GpuHealth,
    MemoryTest,
    PreflightConfig,
    PreflightFacts,
    StressSample,
    run_preflight,
)
from infra.preflight.gpu import parse_dcgm, throttle_names  # noqa: E402

GPU_CHECKS = ("gpu_count", "gpu_matmul", "gpu_throttle", "gpu_memory", "gpu_ecc", "dcgm_diag", "nccl_allreduce")
COOL = GpuHealth(
    sm_clock_mhz=1980,
    max_sm_clock_mhz=1980,
    temperature_c=62,
    throttle=("sw_power_cap",),
    ecc_corrected=0,
    ecc_uncorrected=0,
)


@dataclass
class FakeGpus:
    """Eight H100s that answer from tables; tests change one GPU at a time."""

    n: int = 8
    tflops: dict[int, float] = field(default_factory=dict)
    health_under_load: dict[int, GpuHealth] = field(default_factory=dict)
    health_now: dict[int, GpuHealth] = field(default_factory=dict)
    mismatches: dict[int, int] = field(default_factory=dict)
    cuda: bool = True
    nvml: bool = True
    calls: list[str] = field(default_factory=list)

    def unavailable_reason(self):
        return None if self.cuda else "no CUDA device visible to torch (fake)"

    def device_count(self):
        return self.n if self.cuda else 0

    def name(self, index):
        return "NVIDIA H100 80GB HBM3"

    def matmul(self, index, n, seconds):
        self.calls.append(f"matmul {index} {n}")
        return StressSample(
            self.tflops.get(index, 730.0), self.health_under_load.get(index, COOL) if self.nvml else None
        )

    def memory_test(self, index, gib):
        return MemoryTest(int(gib * 2**30), 5, self.mismatches.get(index, 0), 2500.0)

    def nvml_reason(self):
        return None if self.nvml else "pynvml is not installed (pip install nvidia-ml-py)"

    def health(self, index):
        return self.health_now.get(index, COOL) if self.nvml else None


@dataclass
class FakeCommands:
    programs: dict[str, str] = field(default_factory=dict)
    outputs: dict[str, CommandOutput] = field(default_factory=dict)
    ran: list[list[str]] = field(default_factory=list)

    def which(self, program):
        return self.programs.get(program)

    def run(self, args, timeout, env=None):
        self.ran.append(list(args))
        key = "torchrun" if "torch.distributed.run" in args else Path(args[0]).name
        return self.outputs[key]


def nccl_ok(busbw=380.0) -> CommandOutput:
    data = {"busbw_gbps": busbw, "algbw_gbps": busbw * 8 / 14, "seconds_per_op": 0.001, "world": 8, "correct": True}
    return CommandOutput(0, "PREFLIGHT_ALLREDUCE " + json.dumps(data) + "\n", "")


def run_gpu(gpus, commands=None, facts=None, **config):
    config.setdefault("checks", GPU_CHECKS)
    results = run_preflight(
        PreflightConfig(**config),
        facts or PreflightFacts(device="cuda", nproc_per_node=8),
        gpu=gpus,
        commands=commands or FakeCommands(outputs={"torchrun": nccl_ok()}),
        log=lambda _: None,
    )
    return {r.name: r for r in results}


def test_healthy_node_passes_every_gpu_check():
    cmds = FakeCommands(
        programs={"dcgmi": "/usr/bin/dcgmi"},
        outputs={"torchrun": nccl_ok(), "dcgmi": CommandOutput(0, "| Memory | Pass |\n", "")},
    )
    r = run_gpu(FakeGpus(), cmds)
    assert {n: x.status for n, x in r.items()} == {n: "pass" for n in GPU_CHECKS}
    assert r["gpu_matmul"].metric == 730.0
    assert r["nccl_allreduce"].metric == 380.0
    assert "power-capped" in r["gpu_throttle"].value  # noted, not failed
    assert ["/usr/bin/dcgmi", "diag", "-r", "1"] in cmds.ran


def test_gpu_15_percent_slower_fails_and_is_named():
    r = run_gpu(FakeGpus(tflops={3: 730.0 * 0.85}))
    res = r["gpu_matmul"]
    assert res.status == "fail"
    assert "GPU 3" in res.advice and "-15.0%" in res.advice
    assert res.metric == 730.0 * 0.85


def test_gpu_5_percent_slower_passes():
    assert run_gpu(FakeGpus(tflops={5: 730.0 * 0.95}))["gpu_matmul"].status == "pass"


def test_absolute_floor_fails_uniformly_slow_gpus():
    r = run_gpu(FakeGpus(tflops={i: 500.0 for i in range(8)}), min_gpu_tflops=650)
    assert r["gpu_matmul"].status == "fail"


def test_thermal_throttling_under_load_fails():
    hot = GpuHealth(1400, 1980, 91, ("hw_thermal_slowdown",), 0, 0)
    r = run_gpu(FakeGpus(health_under_load={2: hot}))
    assert r["gpu_throttle"].status == "fail"
    assert "GPU 2: hw_thermal_slowdown" in r["gpu_throttle"].advice
    assert "GPU 2: 91 C" in r["gpu_throttle"].advice


def test_low_clock_without_slowdown_reason_warns():
    slow = GpuHealth(1200, 1980, 70, (), 0, 0)
    assert run_gpu(FakeGpus(health_under_load={1: slow}))["gpu_throttle"].status == "warn"


def test_throttle_reads_idle_health_when_the_stress_did_not_run():
    gpus = FakeGpus(health_now={0: GpuHealth(1980, 1980, 95, (), 0, 0)})
    r = run_gpu(gpus, checks=("gpu_throttle",))
    assert r["gpu_throttle"].status == "fail" and "idle" in r["gpu_throttle"].value
    assert not gpus.calls  # no stress was run


def test_memory_mismatches_fail():
    r = run_gpu(FakeGpus(mismatches={6: 12}))
    assert r["gpu_memory"].status == "fail" and "GPU 6: 12" in r["gpu_memory"].advice


def test_ecc_uncorrected_fails_corrected_warns_pending_remap_warns():
    bad = GpuHealth(1980, 1980, 60, (), ecc_corrected=0, ecc_uncorrected=2)
    assert run_gpu(FakeGpus(health_now={4: bad}))["gpu_ecc"].status == "fail"
    noisy = GpuHealth(1980, 1980, 60, (), ecc_corrected=40, ecc_uncorrected=0)
    assert run_gpu(FakeGpus(health_now={4: noisy}))["gpu_ecc"].status == "warn"
    pending = GpuHealth(1980, 1980, 60, (), 0, 0, remap_pending=True)
    assert run_gpu(FakeGpus(health_now={4: pending}))["gpu_ecc"].status == "warn"
    failed = GpuHealth(1980, 1980, 60, (), 0, 0, remap_failure=True)
    assert run_gpu(FakeGpus(health_now={4: failed}))["gpu_ecc"].status == "fail"
    no_ecc = GpuHealth(1980, 1980, 60, ())
    assert run_gpu(FakeGpus(health_now={i: no_ecc for i in range(8)}))["gpu_ecc"].status == "skip"


def test_without_nvml_health_checks_skip_with_the_install_hint():
    r = run_gpu(FakeGpus(nvml=False))
    assert r["gpu_matmul"].status == "pass"
    for name in ("gpu_throttle", "gpu_ecc"):
        assert r[name].status == "skip" and "nvidia-ml-py" in r[name].advice


def test_gpu_count_against_the_recipe():
    assert run_gpu(FakeGpus(n=7))["gpu_count"].status == "fail"
    assert run_gpu(FakeGpus(n=8), expected_gpus=4)["gpu_count"].status == "warn"
    cpu_recipe = PreflightFacts(device="cpu", nproc_per_node=2)
    assert run_gpu(FakeGpus(cuda=False), facts=cpu_recipe)["gpu_count"].status == "skip"
    missing = run_gpu(FakeGpus(cuda=False))["gpu_count"]  # a cuda recipe on a CPU box
    assert missing.status == "fail" and "8 GPU(s) per node" in missing.advice


def test_without_cuda_every_other_gpu_check_skips_with_the_reason():
    r = run_gpu(FakeGpus(cuda=False), facts=PreflightFacts(device="cpu"))
    for name in GPU_CHECKS:
        assert r[name].status == "skip", name
        assert "no CUDA device" in r[name].advice


def test_dcgm_failure_and_absence():
    table = "| Denylist | Pass |\n| Memory | Fail - GPU: 0 |\n| PCIe | Warn - GPU: 1 |\n"
    cmds = FakeCommands(
        programs={"dcgmi": "dcgmi"}, outputs={"torchrun": nccl_ok(), "dcgmi": CommandOutput(226, table, "")}
    )
    r = run_gpu(FakeGpus(), cmds, dcgm_level=2)
    assert r["dcgm_diag"].status == "fail" and "Memory: Fail - GPU: 0" in r["dcgm_diag"].advice
    assert ["dcgmi", "diag", "-r", "2"] in cmds.ran
    assert run_gpu(FakeGpus())["dcgm_diag"].status == "skip"  # not on PATH
    assert run_gpu(FakeGpus(), dcgm_level=0)["dcgm_diag"].status == "skip"
    no_engine = FakeCommands(
        programs={"dcgmi": "dcgmi"},
        outputs={
            "torchrun": nccl_ok(),
            "dcgmi": CommandOutput(
                255, "Error: unable to establish a connection to the specified host: localhost\n", ""
            ),
        },
    )
    res = run_gpu(FakeGpus(), no_engine)["dcgm_diag"]
    assert res.status == "skip" and "nv-hostengine" in res.advice


def test_parse_dcgm_counts_rows():
    fails, warns, passed = parse_dcgm("+---+\n| Diagnostic | Result |\n| A | Pass |\n| B | Warn x |\n")
    assert (fails, warns, passed) == ([], ["B: Warn x"], 1)


def test_slow_or_broken_nccl_fails():
    slow = run_gpu(FakeGpus(), FakeCommands(outputs={"torchrun": nccl_ok(40.0)}))
    assert slow["nccl_allreduce"].status == "fail" and "NVLink" in slow["nccl_allreduce"].advice
    hung = FakeCommands(outputs={"torchrun": CommandOutput(-1, "", "", timed_out=True)})
    assert "did not finish" in run_gpu(FakeGpus(), hung)["nccl_allreduce"].advice
    assert (
        run_gpu(FakeGpus(n=1), facts=PreflightFacts(device="cuda", nproc_per_node=1))["nccl_allreduce"].status == "skip"
    )


def test_throttle_bits_decode():
    assert throttle_names(0x4 | 0x40) == ("sw_power_cap", "hw_thermal_slowdown")


# --- the real backend's device-agnostic loops on CPU tensors, and its NVML reading ------------


def test_sustained_matmul_and_pattern_test_run_on_any_device():
    import torch

    from infra.preflight.gpu import pattern_test, sustained_matmul

    a, b = torch.randn(64, 64), torch.randn(64, 64)
    samples = []
    tflops, reading = sustained_matmul(a, b, 0.05, lambda: None, lambda: samples.append(1) or "hot")
    assert tflops > 0 and reading == "hot" and samples == [1]
    res = pattern_test(torch.empty(1000, dtype=torch.int64), lambda: None, chunk=300)
    assert (res.bytes_tested, res.patterns, res.mismatches) == (8000, 5, 0)


def test_nvml_backend_reads_health_from_pynvml(monkeypatch):
    import types

    from infra.preflight.gpu import TorchNvmlBackend

    nv = types.SimpleNamespace(
        NVML_CLOCK_SM=1,
        NVML_TEMPERATURE_GPU=0,
        NVML_MEMORY_ERROR_TYPE_CORRECTED=0,
        NVML_MEMORY_ERROR_TYPE_UNCORRECTED=1,
        NVML_VOLATILE_ECC=0,
        nvmlInit=lambda: None,
        nvmlDeviceGetHandleByPciBusId_v2=lambda bus: ("pci", bus),
        nvmlDeviceGetHandleByIndex=lambda i: ("idx", i),
        nvmlDeviceGetClockInfo=lambda h, clock: 1755,
        nvmlDeviceGetMaxClockInfo=lambda h, clock: 1980,
        nvmlDeviceGetTemperature=lambda h, sensor: 71,
        nvmlDeviceGetCurrentClocksEventReasons=lambda h: 0x4 | 0x20,
        nvmlDeviceGetTotalEccErrors=lambda h, kind, counter: 3 if kind == 0 else 0,
        nvmlDeviceGetRemappedRows=lambda h: (0, 0, 1, 0),
    )
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    backend = TorchNvmlBackend()
    assert backend.nvml_reason() is None
    h = backend.health(0)
    assert h == GpuHealth(
        1755, 1980, 71, ("sw_power_cap", "sw_thermal_slowdown"), 3, 0, remap_pending=True, remap_failure=False
    )


def test_nvml_backend_without_pynvml_says_what_to_install(monkeypatch):
    from infra.preflight.gpu import TorchNvmlBackend

    monkeypatch.setitem(sys.modules, "pynvml", None)  # import raises ImportError
    backend = TorchNvmlBackend()
    assert "nvidia-ml-py" in backend.nvml_reason() and backend.health(0) is None
