"""The preflight step: measure the machine, storage, data and recipe before training starts.

    art = ctx.run(preflight, PreflightConfig(...), params={"facts": facts.to_dict(), "run_id": ctx.run_id})

The build runs `infra.preflight.run_preflight`, writes `preflight.json` (every result, the config,
the facts, host and time) and `preflight.md` (the table) into the step folder, and raises
`PreflightFailed` listing the blocking checks when `should_stop` says so, so the flow stops before
any training stage launches. The publish hook records one `preflight` lineage row per check and a
Prefect table artifact.

Caching: preflight measures the machine, so a finished preflight must not stay Cached forever. The
fingerprint therefore holds the run id (params `run_id`; each flow run passes its own, so every run
measures again while a retry of the same run reuses its preflight) and, through `extra`, the host
name (a retry on another machine measures that machine) and, when no run id is given, today's date
(so a preflight outside a flow is reused at most for the day).

Deliberate break of the "build functions stay free of DuckDB" rule: a failing preflight never
reaches `publish` (the step raises, no marker is written), yet failures are what lineage must
remember. The build therefore records the rows of a failing run itself, in the lineage database of
the workspace that holds its step folder (`{workspace}/preflight/{fp}/`), before raising.
"""

from __future__ import annotations

import json
import re
import socket
import time
from pathlib import Path
from typing import Any

from infra.artifact import Artifact
from infra.lineage import Lineage
from infra.preflight import (
    CheckResult,
    PreflightConfig,
    PreflightFacts,
    blocking,
    format_markdown,
    format_table,
    run_preflight,
    should_stop,
    summary,
)
from infra.workspace import Workspace
from tasks.step import step

JSON_NAME, MD_NAME = "preflight.json", "preflight.md"


class PreflightFailed(RuntimeError):
    """Preflight found blocking problems; `results` holds every check's result."""

    def __init__(self, message: str, results: list[CheckResult]):
        super().__init__(message)
        self.results = results


def preflight_extra(config: PreflightConfig, *, facts: dict[str, Any] | None = None,
                    run_id: str | None = None, **_: Any) -> str:
    """Facts outside the config that change the output: this host, and the day without a run id."""
    when = "" if run_id else time.strftime("%Y-%m-%d")
    return f"{socket.gethostname()}|{when}"


def _metric(results: list[CheckResult], name: str) -> float | None:
    return next((r.metric for r in results if r.name == name and r.status != "skip"), None)


def lineage_rows(run_id: str, results: list[CheckResult], created: Any = None) -> list[tuple]:
    """Rows of the lineage `preflight` table: run_id, check_name, status, value, threshold, advice,
    created."""
    from datetime import UTC, datetime

    created = created or datetime.now(UTC).replace(tzinfo=None)
    return [(run_id, r.name, r.status, r.value, r.threshold, r.advice, created) for r in results]


def build_preflight(
    config: PreflightConfig,
    facts: PreflightFacts,
    out: Path,
    *,
    log=print,
    run_id: str | None = None,
    gpu: Any = None,
    commands: Any = None,
    lineage: Lineage | None = None,
) -> dict[str, Any]:
    """Run the checks, write the report into `out`, raise PreflightFailed when training must not start.

    `lineage` receives the rows of a failing run (default: the workspace holding `out`).
    """
    out = Path(out)
    run_id = run_id or f"preflight-{out.name}"
    results = run_preflight(config, facts, gpu=gpu, commands=commands, log=log)
    stop = should_stop(results, config.allow_warn)
    counts = summary(results)
    report = {
        "run_id": run_id,
        "host": socket.gethostname(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "stop": stop,
        "summary": counts,
        "config": config.model_dump(mode="json"),
        "facts": facts.to_dict(),
        "results": [r.to_dict() for r in results],
    }
    (out / JSON_NAME).write_text(json.dumps(report, indent=2), encoding="utf-8")
    head = f"# Preflight on `{report['host']}` ({'STOP' if stop else 'go'})\n\nrun `{run_id}`\n\n"
    (out / MD_NAME).write_text(head + format_markdown(results) + "\n", encoding="utf-8")
    log("preflight report\n" + format_table(results))
    if stop:
        bad = blocking(results, config.allow_warn)
        if lineage is None:
            lineage = Workspace.at(out.parent.parent).lineage()
        lineage.record_rows("preflight", lineage_rows(run_id, results))
        listing = "\n".join(f"  {r.name}: {r.status.upper()} {r.value} -- {r.advice}" for r in bad)
        warn_hint = "" if config.allow_warn or any(r.status == "fail" for r in bad) else (
            "\nonly warnings: rerun with allow_warn=true to proceed anyway"
        )
        raise PreflightFailed(
            f"preflight stopped the run: {len(bad)} blocking check(s) of {len(results)} "
            f"(report: {out / MD_NAME})\n{listing}{warn_hint}",
            results,
        )
    return {
        "run_id": run_id,
        "host": report["host"],
        "summary": counts,
        "allow_warn": config.allow_warn,
        "warned": [r.name for r in results if r.status == "warn"],
        "gpu_tflops": _metric(results, "gpu_matmul"),
        "nccl_busbw_gbps": _metric(results, "nccl_allreduce"),
        "cpu_gflops": _metric(results, "cpu_matmul"),
        "gloo_busbw_gbps": _metric(results, "gloo_allreduce"),
    }


def recipe_facts(recipe: Any, plans: tuple[Artifact, ...] = (), **facts: Any) -> PreflightFacts:
    """Facts the recipe already knows (stage tokens, sequence length, workspace) plus the mixture
    plans' paths; pass the rest (device, nproc_per_node, global_batch, model_vocab, ...) as keywords
    until the recipe carries a training section."""
    stages = tuple(getattr(recipe, "stages", ()) or ())
    known: dict[str, Any] = {
        "workspace": recipe.workspace,
        "stage_tokens": {st.name: st.tokens for st in stages},
        "stage_seq_len": {st.name: st.seq_len for st in stages},
        "seq_len": max((st.seq_len for st in stages), default=0),
        "mixture_plans": tuple(str(Path(a.uri) / "plan.json") for a in plans if a.kind == "mixture"),
    }
    return PreflightFacts(**{**known, **facts})


def read_report(artifact: Artifact) -> dict[str, Any]:
    return json.loads((artifact.path / JSON_NAME).read_text(encoding="utf-8"))


def publish_preflight(artifact: Artifact, ws: Workspace, label: str) -> None:
    """Lineage rows (one per check) and a Prefect table artifact of a finished preflight."""
    from prefect.artifacts import create_table_artifact

    report = read_report(artifact)
    results = [CheckResult(**r) for r in report["results"]]
    ws.lineage().record_rows("preflight", lineage_rows(report["run_id"], results))
    key = re.sub(r"[^a-z0-9-]+", "-", f"preflight-{label}".lower()).strip("-")
    counts = ", ".join(f"{n} {s}" for s, n in report["summary"].items())
    create_table_artifact(
        table=[{"check": r.name, "status": r.status, "value": r.value, "threshold": r.threshold,
                "advice": r.advice} for r in results],
        key=key,
        description=f"Preflight on {report['host']}: {counts}",
    )


@step("preflight", version=1, kind="preflight", extra=preflight_extra, publish=publish_preflight)
def preflight(
    config: PreflightConfig,
    inputs: tuple[Artifact, ...],
    out: Path,
    *,
    log=print,
    facts: dict[str, Any],
    run_id: str | None = None,
) -> dict[str, Any]:
    """Prefect task: run preflight for the recipe's facts (params: facts=PreflightFacts.to_dict())."""
    return build_preflight(config, PreflightFacts.from_dict(facts), out, log=log, run_id=run_id)
