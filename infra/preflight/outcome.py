"""A preflight's report: the files it writes, the error that stops training, the step's summary.

    results = run_preflight(config, facts, log=log)
    report = write_report(out, run_id, config, facts, results, calibration=[...], log=log)
    if report["stop"]:
        raise stop_error(results, config, out)
    return step_summary(report, results)

`preflight.json` holds every result, the config, the facts, the host, the time and the host's
MFU calibration (computed by the caller: model/calibration.py); `preflight.md` holds the table.
The preflight step (tasks/preflight.py) runs these; so can any script that checks a machine.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from infra.preflight.core import (
    CheckResult,
    PreflightConfig,
    PreflightFacts,
    PreflightFailed,
    blocking,
    format_markdown,
    format_table,
    metric_of,
    should_stop,
    summary,
)

REPORT_JSON, REPORT_MD = "preflight.json", "preflight.md"


def write_report(
    out: Path,
    run_id: str,
    config: PreflightConfig,
    facts: PreflightFacts,
    results: list[CheckResult],
    *,
    calibration: list[dict[str, Any]] = (),
    log: Callable[[str], Any] = print,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write `preflight.json` and `preflight.md` into `out`, log the table, return the report
    (`extra`: more keys, e.g. the preflight job's nodes)."""
    out = Path(out)
    stop = should_stop(results, config.allow_warn)
    report = {
        "run_id": run_id,
        "host": socket.gethostname(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "stop": stop,
        "summary": summary(results),
        "config": config.model_dump(mode="json"),
        "facts": facts.to_dict(),
        "results": [r.to_dict() for r in results],
        "calibration": list(calibration),
        **(extra or {}),
    }
    (out / REPORT_JSON).write_text(json.dumps(report, indent=2), encoding="utf-8")
    head = f"# Preflight on `{report['host']}` ({'STOP' if stop else 'go'})\n\nrun `{run_id}`\n\n"
    (out / REPORT_MD).write_text(head + format_markdown(results) + "\n", encoding="utf-8")
    log("preflight report\n" + format_table(results))
    return report


def stop_error(results: list[CheckResult], config: PreflightConfig, out: Path) -> PreflightFailed:
    """The error that stops training: every blocking check with its value and advice."""
    bad = blocking(results, config.allow_warn)
    listing = "\n".join(f"  {r.name}: {r.status.upper()} {r.value} -- {r.advice}" for r in bad)
    only_warnings = not config.allow_warn and not any(r.status == "fail" for r in bad)
    hint = "\nonly warnings: rerun with allow_warn=true to proceed anyway" if only_warnings else ""
    return PreflightFailed(
        f"preflight stopped the run: {len(bad)} blocking check(s) of {len(results)} "
        f"(report: {Path(out) / REPORT_MD})\n{listing}{hint}",
        results,
    )


def step_summary(report: dict[str, Any], results: list[CheckResult]) -> dict[str, Any]:
    """What a passing preflight hands on (the step's metadata): counts, warnings, measured rates."""
    return {
        "run_id": report["run_id"],
        "host": report["host"],
        "summary": report["summary"],
        "allow_warn": report["config"]["allow_warn"],
        "warned": [r.name for r in results if r.status == "warn"],
        "gpu_tflops": metric_of(results, "gpu_matmul"),
        "nccl_busbw_gbps": metric_of(results, "nccl_allreduce"),
        "cpu_gflops": metric_of(results, "cpu_matmul"),
        "gloo_busbw_gbps": metric_of(results, "gloo_allreduce"),
        "calibration": report["calibration"],
    }
