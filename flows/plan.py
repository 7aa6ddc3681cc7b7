"""`smollm3 plan RECIPE`: a dry run of the DAG that lists every step as run or reuse.

The plan is exact without any compute because a step's fingerprint depends only on its config,
its version, cheap facts (`extra`: file digests, installed packages) and its inputs' fingerprints,
never on what the inputs contain. `PlanContext.run` computes each fingerprint, looks for the
finished step folder, and for a step that would run, names the config fields that changed since
the newest version of the same step and label recorded in lineage (or that its inputs changed).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from infra.artifact import Artifact, config_dict, fingerprint, read_marker
from infra.lineage import Lineage
from infra.workspace import Workspace


@dataclass(frozen=True)
class PlanRow:
    step: str
    label: str
    fingerprint: str
    action: str  # run | reuse
    reason: str


def diff(old: Any, new: Any, path: str = "") -> list[str]:
    """Dotted paths whose values differ between two JSON-like configs, with old -> new."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for key in sorted(set(old) | set(new)):
            sub = f"{path}.{key}" if path else str(key)
            if key not in old:
                out.append(f"{sub}: (new) -> {new[key]!r}")
            elif key not in new:
                out.append(f"{sub}: {old[key]!r} -> (removed)")
            else:
                out += diff(old[key], new[key], sub)
        return out
    return [] if old == new else [f"{path or '(value)'}: {old!r} -> {new!r}"]


class PlanContext:
    """Stands in for RunContext: same `run` interface, no compute."""

    run_id = "plan"

    def __init__(self, recipe, refresh: frozenset[str] = frozenset()):
        self.ws = Workspace.at(recipe.workspace)
        self.lineage = Lineage(self.ws.lineage_path)
        self.refresh = refresh
        self.rows: list[PlanRow] = []

    def run(self, task, config, inputs=(), label: str = "", params: dict[str, Any] | None = None) -> Artifact:
        d = task.definition
        params = params or {}
        try:
            fp = d.fingerprint(config, tuple(inputs), params)
        except (OSError, ValueError, KeyError) as exc:
            # A fact outside the config is not available here (e.g. a files: source whose data
            # lives on the cluster): plan the step as a run and carry on with a stand-in.
            fp = fingerprint(d.name, d.version, {"config": config, "params": d.identity(params)}, tuple(inputs),
                             extra=f"unresolved: {exc}")
            folder = self.ws.path / d.name / fp[:12]
            self.rows.append(PlanRow(d.name, label, fp, "run", f"input not available here: {exc}"))
            return Artifact(kind=d.kind, uri=str(folder), fingerprint=fp, meta={})
        folder = self.ws.path / d.name / fp[:12]
        record = read_marker(folder)
        if record is not None and d.name not in self.refresh:
            self.rows.append(PlanRow(d.name, label, fp, "reuse", f"finished at {folder}"))
            return Artifact(**record["artifact"])
        if record is not None:
            reason = "refresh requested"
        else:
            reason = self._why(d.name, label, config, inputs, folder)
        self.rows.append(PlanRow(d.name, label, fp, "run", reason))
        return Artifact(kind=d.kind, uri=str(folder), fingerprint=fp, meta={})

    def _why(self, step: str, label: str, config, inputs, folder) -> str:
        if folder.exists():
            return "an earlier attempt left this folder unfinished (resumable steps continue it)"
        previous = self.lineage.query_dicts(
            "SELECT fingerprint, config FROM artifacts WHERE step = ? AND label = ? "
            "ORDER BY created DESC LIMIT 1", [step, label],
        )
        if not previous:
            return "never built"
        old = json.loads(previous[0]["config"]) if previous[0]["config"] else {}
        changed = diff(old, config_dict(config))
        parents = {r["fingerprint"] for r in self.lineage.parents(previous[0]["fingerprint"])}
        upstream = {a.fingerprint for a in inputs} != parents
        parts = []
        if changed:
            parts.append("config changed: " + "; ".join(changed[:8]) + (" ..." if len(changed) > 8 else ""))
        if upstream:
            parts.append("inputs changed (an upstream step reruns or was rebuilt)")
        return ", ".join(parts) or "version, code facts or environment changed (e.g. source files, installed packages)"


def plan(recipe, refresh: frozenset[str] = frozenset()) -> list[PlanRow]:
    from flows.smollm3 import dag

    ctx = PlanContext(recipe, refresh)
    dag(ctx, recipe)
    return ctx.rows


def format_plan(rows: list[PlanRow]) -> str:
    width = max((len(f"{r.step}[{r.label}]") for r in rows), default=10) + 2
    lines = [f"{'step':<{width}}{'action':<8}{'fingerprint':<14}why"]
    for r in rows:
        lines.append(f"{r.step + '[' + r.label + ']':<{width}}{r.action:<8}{r.fingerprint[:12]:<14}{r.reason}")
    runs = sum(r.action == "run" for r in rows)
    lines.append(f"{len(rows)} steps: {runs} run, {len(rows) - runs} reuse")
    return "\n".join(lines)
