"""Running the selected preflight checks against the real machine (or given backends).

Kept apart from core.py, which only defines checks, configs and results: the default backends
(NVML/torch for GPUs, subprocesses for commands) import the check modules, which import core.
"""

from __future__ import annotations

import dataclasses
import time
import traceback
from collections.abc import Callable
from typing import Any

from infra.preflight.commands import SubprocessRunner
from infra.preflight.core import (
    CheckContext,
    CheckResult,
    PreflightConfig,
    PreflightFacts,
    selected,
)
from infra.preflight.gpu import TorchNvmlBackend


def run_preflight(
    config: PreflightConfig,
    facts: PreflightFacts,
    *,
    gpu: Any = None,
    commands: Any = None,
    log: Callable[[str], None] = print,
) -> list[CheckResult]:
    """Run the selected checks in order; a check that raises is reported as fail, never hidden."""
    ctx = CheckContext(
        config=config,
        facts=facts,
        gpu=gpu if gpu is not None else TorchNvmlBackend(),
        commands=commands if commands is not None else SubprocessRunner(),
        log=log,
    )
    results: list[CheckResult] = []
    for cls in selected(config):
        if cls.name in config.skip:
            results.append(CheckResult(cls.name, "skip", advice="skipped by config (skip)"))
            continue
        start = time.monotonic()
        try:
            res = cls().run(ctx)
        except Exception as exc:  # a broken check must show up as a fail with its cause
            last = traceback.format_exception_only(type(exc), exc)[-1].strip()
            res = CheckResult(cls.name, "fail", advice=f"check raised {last}")
        res = dataclasses.replace(res, seconds=round(time.monotonic() - start, 3))
        log(f"preflight {res.name}: {res.status} {res.value}".rstrip())
        results.append(res)
    return results
