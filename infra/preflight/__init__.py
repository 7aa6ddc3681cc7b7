"""Preflight checks: measure the machine, storage, data and recipe before a long training run.

    from infra.preflight import PreflightConfig, PreflightFacts, run_preflight, format_table
    results = run_preflight(PreflightConfig(), PreflightFacts(device="cuda", nproc_per_node=8, ...))
    print(format_table(results))
    if should_stop(results, allow_warn=False): ...

Checks live in one module per group (review, gpu, compute, host, storage, data) and register themselves
in `CHECKS`; importing this package registers them all. See docs/preflight.md.
"""

from infra.preflight import compute, data, gpu, host, review, storage  # noqa: F401  (registers checks)
from infra.preflight.commands import CommandOutput, CommandRunner, SubprocessRunner
from infra.preflight.core import (
    CHECKS,
    Check,
    CheckContext,
    CheckResult,
    PreflightConfig,
    PreflightFacts,
    blocking,
    format_markdown,
    format_table,
    register,
    should_stop,
    summary,
)
from infra.preflight.gpu import GpuBackend, GpuHealth, MemoryTest, StressSample, TorchNvmlBackend
from infra.preflight.run import run_preflight

__all__ = [
    "CHECKS",
    "Check",
    "CheckContext",
    "CheckResult",
    "CommandOutput",
    "CommandRunner",
    "GpuBackend",
    "GpuHealth",
    "MemoryTest",
    "PreflightConfig",
    "PreflightFacts",
    "StressSample",
    "SubprocessRunner",
    "TorchNvmlBackend",
    "blocking",
    "format_markdown",
    "format_table",
    "register",
    "run_preflight",
    "should_stop",
    "summary",
]
