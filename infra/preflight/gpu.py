"""GPU checks and the device layer they run on: count, bf16 matmul stress, throttling, memory
patterns, ECC, DCGM diagnostics and the NCCL all-reduce.

Every check talks to the GPUs through a `GpuBackend`; `TorchNvmlBackend` is the real one (torch for
CUDA work, NVML for clocks, temperatures, throttle reasons and ECC counters) and tests inject a
fake, so the pass/warn/fail logic is exercised on CPU. NVML comes from `pynvml` (the
`nvidia-ml-py` distribution) when it is importable; it is deliberately not a dependency, so the
NVML-based checks skip with a reason where it is missing. Without CUDA every GPU check skips with
the reason, except `gpu_count`, which fails when the recipe trains on CUDA.

Rules (Smol Training Playbook): a GPU more than 10% below the best one fails, and so does any
thermal or hardware slowdown. A software power cap under a full-size matmul is normal on H100 and
only noted: a GPU capped harder than its peers shows up as slow in `gpu_matmul` anyway.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from infra.preflight.collective import run_allreduce
from infra.preflight.core import Check, CheckContext, CheckResult, register

# NVML clocks-event (throttle) reason bits; stable across driver versions.
THROTTLE_BITS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}
BAD_THROTTLE = {"hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown"}


def throttle_names(mask: int) -> tuple[str, ...]:
    return tuple(name for bit, name in THROTTLE_BITS.items() if mask & bit)


@dataclass(frozen=True)
class GpuHealth:
    """One NVML reading of a GPU; None fields were not reported by this GPU or driver."""

    sm_clock_mhz: float | None = None
    max_sm_clock_mhz: float | None = None
    temperature_c: float | None = None
    throttle: tuple[str, ...] = ()  # active clocks-event reasons (THROTTLE_BITS names)
    ecc_corrected: int | None = None  # volatile (since boot/reset) corrected ECC errors
    ecc_uncorrected: int | None = None  # volatile uncorrected ECC errors
    remap_pending: bool = False  # row remapping waits for a GPU reset
    remap_failure: bool = False  # row remapping failed: the GPU needs service


@dataclass(frozen=True)
class StressSample:
    tflops: float  # sustained dense bf16 TFLOP/s
    health: GpuHealth | None  # NVML reading taken while matmuls were still queued


@dataclass(frozen=True)
class MemoryTest:
    bytes_tested: int
    patterns: int
    mismatches: int
    gbps: float  # write+read bandwidth over all patterns


def sustained_matmul(a: Any, b: Any, seconds: float, sync: Any, sample: Any) -> tuple[float, Any]:
    """TFLOP/s of back-to-back `a @ b` (square, n x n) for `seconds`, and `sample()` taken while
    kernels are still queued (a reading under load). Device-agnostic: `sync` waits for the device."""
    import torch

    n = a.shape[0]
    c = torch.empty_like(a)
    for _ in range(3):  # warm up the BLAS heuristics and the clocks
        torch.mm(a, b, out=c)
    sync()
    batch, count, reading = 10, 0, None
    start = time.perf_counter()
    while True:
        for _ in range(batch):
            torch.mm(a, b, out=c)
        count += batch
        if reading is None and time.perf_counter() - start >= 0.7 * seconds:
            reading = sample()
        sync()
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            break
    if reading is None:  # one batch outlasted the whole window: read right after it
        reading = sample()
    return 2.0 * n**3 * count / elapsed / 1e12, reading


# All zeros, all ones and the two checkerboards (0x55.., 0xAA.. as int64): every bit flips both ways.
PATTERNS = (0, -1, 0x5555555555555555, -0x5555555555555556)


def pattern_test(t: Any, sync: Any, chunk: int = 1 << 26) -> MemoryTest:
    """Write and read back PATTERNS, then each word's own index (catches swapped or aliased
    addresses), over the int64 tensor `t`. Device-agnostic: `sync` waits for the device."""
    import torch

    numel = t.numel()
    mismatches = 0
    sync()
    start = time.perf_counter()
    for p in PATTERNS:
        t.fill_(p)
        mismatches += int((t != p).sum())
    torch.arange(numel, out=t)
    for lo in range(0, numel, chunk):
        hi = min(lo + chunk, numel)
        expected = torch.arange(lo, hi, device=t.device, dtype=torch.int64)
        mismatches += int((t[lo:hi] != expected).sum())
    sync()
    elapsed = time.perf_counter() - start
    passes = len(PATTERNS) + 1
    nbytes = numel * 8
    return MemoryTest(nbytes, passes, mismatches, 2 * nbytes * passes / elapsed / 1e9)


class GpuBackend(Protocol):
    """The device layer of the GPU checks (real: TorchNvmlBackend; tests: a fake)."""

    def unavailable_reason(self) -> str | None: ...  # None when CUDA is usable

    def device_count(self) -> int: ...

    def name(self, index: int) -> str: ...

    def matmul(self, index: int, n: int, seconds: float) -> StressSample: ...

    def memory_test(self, index: int, gib: float) -> MemoryTest: ...

    def nvml_reason(self) -> str | None: ...  # None when NVML readings are available

    def health(self, index: int) -> GpuHealth | None: ...


class TorchNvmlBackend:
    """CUDA through torch, health through NVML (pynvml) when importable."""

    def __init__(self) -> None:
        self._nvml: Any = None
        self._nvml_error: str | None = None
        self._nvml_tried = False
        self._nvml_lock = threading.Lock()  # GPU threads ask at once; initialise NVML once

    # --- CUDA ---------------------------------------------------------------------------------
    def unavailable_reason(self) -> str | None:
        import torch

        if not torch.cuda.is_available():
            build = "CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
            return f"no CUDA device visible to torch {torch.__version__} ({build})"
        return None

    def device_count(self) -> int:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0

    def name(self, index: int) -> str:
        import torch

        return torch.cuda.get_device_name(index)

    def matmul(self, index: int, n: int, seconds: float) -> StressSample:
        import torch

        dev = torch.device("cuda", index)
        with torch.cuda.device(dev):
            a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)  # (n, n)
            b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
            tflops, health = sustained_matmul(
                a, b, seconds, lambda: torch.cuda.synchronize(dev), lambda: self.health(index)
            )
            del a, b
            torch.cuda.empty_cache()
        return StressSample(tflops, health)

    def memory_test(self, index: int, gib: float) -> MemoryTest:
        import torch

        dev = torch.device("cuda", index)
        with torch.cuda.device(dev):
            free, _ = torch.cuda.mem_get_info(dev)
            nbytes = int(min(gib * 2**30, 0.8 * free)) // 8 * 8
            t = torch.empty(nbytes // 8, dtype=torch.int64, device=dev)
            result = pattern_test(t, lambda: torch.cuda.synchronize(dev))
            del t
            torch.cuda.empty_cache()
        return result

    # --- NVML ---------------------------------------------------------------------------------
    def _nvml_module(self) -> Any:
        with self._nvml_lock:
            if not self._nvml_tried:
                self._nvml_tried = True
                try:
                    import pynvml

                    pynvml.nvmlInit()
                    self._nvml = pynvml
                except ImportError:
                    self._nvml_error = "pynvml is not installed (pip install nvidia-ml-py)"
                except Exception as exc:  # NVMLError: no driver, no permission
                    self._nvml_error = f"NVML did not initialise: {exc}"
        return self._nvml

    def nvml_reason(self) -> str | None:
        return None if self._nvml_module() is not None else self._nvml_error

    def _handle(self, nv: Any, index: int) -> Any:
        # CUDA and NVML may number GPUs differently (CUDA_VISIBLE_DEVICES): match by PCI bus id.
        import torch

        try:
            p = torch.cuda.get_device_properties(index)
            bus = f"{p.pci_domain_id:08x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
            return nv.nvmlDeviceGetHandleByPciBusId_v2(bus)
        except Exception:
            return nv.nvmlDeviceGetHandleByIndex(index)

    def health(self, index: int) -> GpuHealth | None:
        nv = self._nvml_module()
        if nv is None:
            return None
        h = self._handle(nv, index)

        def read(fn: Any, *args: Any) -> Any:
            try:
                return fn(h, *args)
            except Exception:  # NVMLError_NotSupported and friends: leave the field empty
                return None

        # the newer name first; older pynvml only has the "throttle" spelling
        reasons_fn = (
            getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or nv.nvmlDeviceGetCurrentClocksThrottleReasons
        )
        mask = read(reasons_fn) or 0
        remap = read(getattr(nv, "nvmlDeviceGetRemappedRows", lambda _h: None))
        return GpuHealth(
            sm_clock_mhz=read(nv.nvmlDeviceGetClockInfo, nv.NVML_CLOCK_SM),
            max_sm_clock_mhz=read(nv.nvmlDeviceGetMaxClockInfo, nv.NVML_CLOCK_SM),
            temperature_c=read(nv.nvmlDeviceGetTemperature, nv.NVML_TEMPERATURE_GPU),
            throttle=throttle_names(int(mask)),
            ecc_corrected=read(
                nv.nvmlDeviceGetTotalEccErrors, nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_VOLATILE_ECC
            ),
            ecc_uncorrected=read(
                nv.nvmlDeviceGetTotalEccErrors, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC
            ),
            remap_pending=bool(remap[2]) if remap else False,
            remap_failure=bool(remap[3]) if remap else False,
        )


def _each_gpu(ctx: CheckContext, fn: Any) -> dict[int, Any]:
    """Run `fn(index)` on every GPU at once: concurrent load is how throttling shows up."""
    n = ctx.gpu.device_count()
    with ThreadPoolExecutor(max_workers=max(n, 1)) as pool:
        return dict(zip(range(n), pool.map(fn, range(n)), strict=True))


@register
class GpuCount(Check):
    """The GPUs torch sees on this node against what the recipe launches."""

    name, group, order = "gpu_count", "gpu", 10

    def run(self, ctx: CheckContext) -> CheckResult:
        f, c = ctx.facts, ctx.config
        expected = c.expected_gpus
        if expected is None and f.device == "cuda":
            expected = f.nproc_per_node
        reason = ctx.gpu.unavailable_reason()
        if reason is not None:
            if expected:
                return self.result(
                    "fail",
                    "0 GPUs",
                    f"== {expected} per node",
                    f"the recipe trains on {expected} GPU(s) per node but {reason}; "
                    "run preflight on a GPU node or fix the driver/CUDA install",
                )
            return self.skip(f"{reason}; the recipe trains on CPU")
        n = ctx.gpu.device_count()
        names = sorted({ctx.gpu.name(i) for i in range(n)})
        value = f"{n} GPUs ({', '.join(names)})"
        if expected is None:
            return self.result("pass", value, "none set", metric=n)
        if n < expected:
            return self.result(
                "fail",
                value,
                f"== {expected} per node",
                f"the recipe launches {expected} ranks per node (nproc_per_node) but only {n} "
                "GPUs are visible: check CUDA_VISIBLE_DEVICES, the Slurm --gpus request, or a dead GPU",
                metric=n,
            )
        if n > expected:
            return self.result(
                "warn",
                value,
                f"== {expected} per node",
                f"{n - expected} GPU(s) would sit idle: raise nproc_per_node or set expected_gpus",
                metric=n,
            )
        return self.result("pass", value, f"== {expected} per node", metric=n)


@register
class GpuMatmul(Check):
    """Sustained n x n bf16 matmul TFLOP/s per GPU, all GPUs loaded at once."""

    name, group, order = "gpu_matmul", "gpu", 20

    def run(self, ctx: CheckContext) -> CheckResult:
        reason = ctx.gpu.unavailable_reason()
        if reason is not None:
            return self.skip(reason)
        c = ctx.config
        samples: dict[int, StressSample] = _each_gpu(ctx, lambda i: ctx.gpu.matmul(i, c.matmul_size, c.matmul_seconds))
        ctx.memo["gpu_stress"] = samples
        rates = {i: s.tflops for i, s in samples.items()}
        best, worst = max(rates.values()), min(rates.values())
        floor = (1 - c.gpu_slow_fraction) * best
        slow = {i: r for i, r in rates.items() if r < floor or r < c.min_gpu_tflops}
        value = f"min {worst:.1f} / best {best:.1f} TFLOP/s over {len(rates)} GPUs"
        threshold = f">= {100 * (1 - c.gpu_slow_fraction):.0f}% of best ({floor:.1f})"
        if c.min_gpu_tflops:
            threshold += f" and >= {c.min_gpu_tflops:.0f}"
        if slow:
            detail = ", ".join(f"GPU {i}: {r:.1f} ({100 * (r / best - 1):+.1f}%)" for i, r in slow.items())
            return self.result(
                "fail",
                value,
                threshold,
                f"slow GPU(s) {detail}: check gpu_throttle, reseat or drain the node; one slow GPU "
                "sets the pace of every synchronous step",
                metric=worst,
            )
        return self.result("pass", value, threshold, metric=worst)


@register
class GpuThrottle(Check):
    """Clocks, temperatures and clocks-event (throttle) reasons, read under the matmul load."""

    name, group, order = "gpu_throttle", "gpu", 21

    def run(self, ctx: CheckContext) -> CheckResult:
        reason = ctx.gpu.unavailable_reason() or ctx.gpu.nvml_reason()
        if reason is not None:
            return self.skip(reason)
        c = ctx.config
        stress: dict[int, StressSample] | None = ctx.memo.get("gpu_stress")
        when = "under load"
        if stress and all(s.health is not None for s in stress.values()):
            readings = {i: s.health for i, s in stress.items()}
        else:
            when = "idle (run gpu_matmul first for readings under load)"
            readings = {i: ctx.gpu.health(i) for i in range(ctx.gpu.device_count())}
        fails, warns, notes = [], [], []
        temps, fractions = [], []
        for i, h in readings.items():
            if h is None:
                continue
            bad = sorted(set(h.throttle) & BAD_THROTTLE)
            if bad:
                fails.append(f"GPU {i}: {', '.join(bad)}")
            if h.temperature_c is not None:
                temps.append(h.temperature_c)
                if h.temperature_c >= c.max_gpu_temp_c:
                    fails.append(f"GPU {i}: {h.temperature_c:.0f} C")
            if h.sm_clock_mhz and h.max_sm_clock_mhz:
                frac = h.sm_clock_mhz / h.max_sm_clock_mhz
                fractions.append(frac)
                if frac < c.min_clock_fraction and "gpu_idle" not in h.throttle:
                    warns.append(f"GPU {i}: SM clock {h.sm_clock_mhz:.0f}/{h.max_sm_clock_mhz:.0f} MHz")
            if "sw_power_cap" in h.throttle:
                notes.append(i)
        parts = []
        if temps:
            parts.append(f"max {max(temps):.0f} C")
        if fractions:
            parts.append(f"SM clock >= {100 * min(fractions):.0f}% of max")
        if notes:
            parts.append(f"power-capped GPUs {notes}")
        value = ", ".join(parts) + f" ({when})"
        threshold = (
            f"no thermal/HW slowdown, < {c.max_gpu_temp_c:.0f} C, clock >= {100 * c.min_clock_fraction:.0f}% of max"
        )
        if fails:
            return self.result(
                "fail",
                value,
                threshold,
                f"throttling {'; '.join(fails)}: check cooling, airflow and power delivery "
                "(nvidia-smi -q -d PERFORMANCE), then drain the node",
            )
        if warns:
            return self.result(
                "warn",
                value,
                threshold,
                f"low clocks {'; '.join(warns)}: check application clocks and power limits "
                "(nvidia-smi -q -d CLOCK,POWER)",
            )
        return self.result("pass", value, threshold)


@register
class GpuMemory(Check):
    """Write/read patterns (zeros, ones, checkerboards, addresses) over a large allocation."""

    name, group, order = "gpu_memory", "gpu", 30

    def run(self, ctx: CheckContext) -> CheckResult:
        reason = ctx.gpu.unavailable_reason()
        if reason is not None:
            return self.skip(reason)
        tests: dict[int, MemoryTest] = _each_gpu(ctx, lambda i: ctx.gpu.memory_test(i, ctx.config.gpu_memory_gib))
        gib = min(t.bytes_tested for t in tests.values()) / 2**30
        bad = {i: t.mismatches for i, t in tests.items() if t.mismatches}
        slowest = min(t.gbps for t in tests.values())
        value = (
            f"{gib:.1f} GiB x {next(iter(tests.values())).patterns} patterns on {len(tests)} GPUs, "
            f"{sum(bad.values())} mismatches, >= {slowest:.0f} GB/s"
        )
        if bad:
            detail = ", ".join(f"GPU {i}: {n}" for i, n in bad.items())
            return self.result(
                "fail",
                value,
                "0 mismatches",
                f"memory corruption on {detail}: drain the node and report the GPU for RMA",
            )
        return self.result("pass", value, "0 mismatches", metric=slowest)


@register
class GpuEcc(Check):
    """ECC error counters and row remapping through NVML (after the stress and memory tests)."""

    name, group, order = "gpu_ecc", "gpu", 31

    def run(self, ctx: CheckContext) -> CheckResult:
        reason = ctx.gpu.unavailable_reason() or ctx.gpu.nvml_reason()
        if reason is not None:
            return self.skip(reason)
        c = ctx.config
        readings = {i: ctx.gpu.health(i) for i in range(ctx.gpu.device_count())}
        reported = {i: h for i, h in readings.items() if h and h.ecc_uncorrected is not None}
        if not reported:
            return self.skip("NVML reports no ECC counters (ECC disabled or not supported)")
        corrected = sum(h.ecc_corrected or 0 for h in reported.values())
        uncorrected = sum(h.ecc_uncorrected or 0 for h in reported.values())
        value = f"{uncorrected} uncorrected, {corrected} corrected (volatile) on {len(reported)} GPUs"
        threshold = f"0 uncorrected, < {c.ecc_corrected_warn} corrected"
        failing = [i for i, h in readings.items() if h and (h.ecc_uncorrected or h.remap_failure)]
        if failing:
            return self.result(
                "fail",
                value,
                threshold,
                f"uncorrected ECC errors or failed row remapping on GPU(s) {failing}: drain the "
                "node; the GPU needs a reset or service",
                metric=uncorrected,
            )
        pending = [i for i, h in readings.items() if h and h.remap_pending]
        if pending:
            return self.result(
                "warn",
                value,
                threshold,
                f"row remapping pending on GPU(s) {pending}: reset the GPU (nvidia-smi -r) before training",
                metric=uncorrected,
            )
        noisy = [i for i, h in reported.items() if (h.ecc_corrected or 0) >= c.ecc_corrected_warn]
        if noisy:
            return self.result(
                "warn",
                value,
                threshold,
                f"corrected ECC errors on GPU(s) {noisy}: watch for growth; a rising count precedes "
                "uncorrectable errors",
                metric=uncorrected,
            )
        return self.result("pass", value, threshold, metric=uncorrected)


DCGM_TIMEOUT_S = {1: 300.0, 2: 900.0, 3: 3600.0}  # -r 1 seconds, -r 2 < 2 min, -r 3 < 30 min


def parse_dcgm(text: str) -> tuple[list[str], list[str], int]:
    """Failing and warning test rows of `dcgmi diag` table output, and the rows that passed."""
    fails, warns, passed = [], [], 0
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != 2 or not cells[0] or not cells[1]:
            continue
        test, result = cells
        word = result.split()[0].lower() if result.split() else ""
        if word.startswith("fail"):
            fails.append(f"{test}: {result}")
        elif word.startswith("warn"):
            warns.append(f"{test}: {result}")
        elif word.startswith("pass"):
            passed += 1
    return fails, warns, passed


@register
class DcgmDiag(Check):
    """NVIDIA DCGM diagnostics (`dcgmi diag -r N`) when DCGM is installed."""

    name, group, order = "dcgm_diag", "gpu", 40

    def run(self, ctx: CheckContext) -> CheckResult:
        level = ctx.config.dcgm_level
        if level == 0:
            return self.skip("dcgm_level is 0")
        reason = ctx.gpu.unavailable_reason()
        if reason is not None:
            return self.skip(reason)
        dcgmi = ctx.commands.which("dcgmi")
        if dcgmi is None:
            return self.skip("dcgmi is not on PATH (install NVIDIA DCGM and start nv-hostengine)")
        out = ctx.commands.run([dcgmi, "diag", "-r", str(level)], timeout=DCGM_TIMEOUT_S[level])
        fails, warns, passed = parse_dcgm(out.stdout)
        value = f"level {level}: {passed} passed, {len(warns)} warned, {len(fails)} failed"
        threshold = "no Fail rows, exit 0"
        said = (out.stdout + out.stderr).lower()
        if out.rc != 0 and not (fails or warns or passed) and "connect" in said:
            # the client is installed but no host engine runs: DCGM could not test anything
            return self.skip(
                "dcgmi cannot reach the DCGM host engine (start nv-hostengine): "
                + (out.stderr or out.stdout).strip()[-200:]
            )
        if out.timed_out:
            return self.result(
                "fail",
                value,
                threshold,
                f"dcgmi diag -r {level} timed out after {DCGM_TIMEOUT_S[level]:.0f} s: a hung GPU or hostengine",
            )
        if fails or out.rc != 0:
            tail = "; ".join(fails) or (out.stderr or out.stdout).strip()[-300:]
            return self.result("fail", value, threshold, f"dcgmi diag failed (rc {out.rc}): {tail}")
        if warns:
            return self.result("warn", value, threshold, "; ".join(warns))
        return self.result("pass", value, threshold)


@register
class NcclAllReduce(Check):
    """NCCL all-reduce bus bandwidth across this node's GPUs (a torchrun job)."""

    name, group, order = "nccl_allreduce", "gpu", 50

    def run(self, ctx: CheckContext) -> CheckResult:
        reason = ctx.gpu.unavailable_reason()
        if reason is not None:
            return self.skip(reason)
        n = ctx.gpu.device_count()
        if n < 2:
            return self.skip(f"needs 2+ GPUs on this node, found {n}")
        c = ctx.config
        res = run_allreduce(ctx.commands, "nccl", n, c.nccl_mib, c.collective_iters, c.collective_timeout_s)
        if res.error:
            return self.result("fail", "", "", f"NCCL all-reduce over {n} GPUs failed: {res.error}")
        value = f"{res.busbw_gbps:.1f} GB/s busbw ({res.algbw_gbps:.1f} algbw, {c.nccl_mib:g} MiB, {n} ranks)"
        threshold = f">= {c.min_nccl_busbw_gbps:g} GB/s"
        if res.busbw_gbps < c.min_nccl_busbw_gbps:
            return self.result(
                "fail",
                value,
                threshold,
                "slow intra-node all-reduce: check NVLink/NVSwitch (nvidia-smi topo -m, "
                "nvidia-smi nvlink -s) and NCCL_P2P/NCCL_SHM settings",
                metric=res.busbw_gbps,
            )
        return self.result("pass", value, threshold, metric=res.busbw_gbps)


def cuda_available() -> bool:
    """`torch.cuda.is_available()`, without importing torch (a second or more) on a host that has
    no GPU device node at all, where torch can only answer False: `smollm3 plan` builds this
    config on laptops and login nodes."""
    import os

    if not any(os.path.exists(node) for node in ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg")):
        return False
    import torch

    return torch.cuda.is_available()
