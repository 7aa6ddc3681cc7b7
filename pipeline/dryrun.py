"""The dry run: each step of a graph as run or reuse, and why (`smollm3 plan`, flows/graphs.py).

The plan is the flow's own graph (pipeline/graph.py): every fingerprint is known before anything
runs, because it depends only on the step's version, the identity fields of its config, the facts
its `extra` reads (file digests) and its inputs' fingerprints, never on what the inputs contain.
A step is reused when its folder for that fingerprint is finished; otherwise the plan says why it
would run: never built, refresh requested, an unfinished attempt (resumable steps continue it),
or what differs from the newest build of the same step and label in lineage (config fields with
old -> new, inputs whose upstream step reruns or was rebuilt, facts such as source file digests,
the step's version).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipeline.artifact import identity, read_marker
from pipeline.graph import Graph, Node
from pipeline.lineage import Lineage
from pipeline.workspace import Workspace


@dataclass(frozen=True)
class PlanRow:
    step: str
    label: str
    fingerprint: str
    action: str  # run | reuse
    reason: str
    launch: str = ""  # where a launched step's job runs (configs with `launch_summary`), else ""
    note: str = ""  # what else the config says about the step (configs with `plan_summary`), else ""

    @property
    def key(self) -> str:
        return f"{self.step}[{self.label}]"


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


def plan_graph(g: Graph, ws: Workspace, refresh: frozenset[str] = frozenset()) -> list[PlanRow]:
    unknown = sorted(set(refresh) - set(g.steps))
    if unknown:
        raise ValueError(
            f"refresh names unknown step(s) {', '.join(unknown)}; steps of flow {g.name!r}: {', '.join(g.steps)}"
        )
    lineage = Lineage(ws.lineage_path)
    rows: list[PlanRow] = []
    runs: set[str] = set()
    with lineage.reading():  # a few reads per step: one connection, not one per read
        for node in g:
            action, reason = _decide(node, ws, lineage, refresh, runs)
            if action == "run":
                runs.add(node.key)
            summary = getattr(node.config, "launch_summary", None)
            note = getattr(node.config, "plan_summary", None)
            rows.append(
                PlanRow(
                    node.step.name,
                    node.label,
                    node.fingerprint,
                    action,
                    reason,
                    summary() if callable(summary) else "",
                    note() if callable(note) else "",
                )
            )
    return rows


def _decide(node: Node, ws: Workspace, lineage: Lineage, refresh: frozenset[str], runs: set[str]) -> tuple[str, str]:
    if node.unresolved:
        return "run", f"input not available here: {node.unresolved}"
    folder = ws.path / node.step.name / node.short
    finished = read_marker(folder) is not None
    if finished and node.step.name not in refresh:
        return "reuse", f"finished at {folder}"
    if finished:
        return "run", "refresh requested"
    if folder.exists():
        return "run", "an earlier attempt left this folder unfinished (resumable steps continue it)"
    previous = lineage.previous(node.step.name, node.label)
    if previous is None:
        return "run", "never built"
    before, old_config, parents = previous
    parts = []
    changed = diff(old_config, identity(node.config))
    if changed:
        parts.append("config changed: " + "; ".join(changed[:8]) + (" ..." if len(changed) > 8 else ""))
    moved = [ref for ref in node.refs() if ref.fingerprint not in parents]
    if moved:
        names = sorted({getattr(r, "key", "a given artifact") for r in moved})
        why = [f"{n} reruns" if n in runs else f"{n} was rebuilt" for n in names]
        parts.append("inputs changed: " + ", ".join(why))
    if not parts:
        marker = read_marker(before.path) if not before.uri.startswith("s3://") else None
        if marker is not None and marker.get("version") != node.step.version:
            parts.append(f"step version {marker.get('version')} -> {node.step.version}")
        elif marker is not None and marker.get("extra") != node.extra:
            parts.append(f"facts outside the config changed ({marker.get('extra')} -> {node.extra})")
        else:
            parts.append("version or facts outside the config changed (source files, step version)")
    return "run", ", ".join(parts)


def format_plan(rows: list[PlanRow]) -> str:
    width = max((len(r.key) for r in rows), default=10) + 2
    lines = [f"{'step':<{width}}{'action':<8}{'fingerprint':<14}why"]
    for r in rows:
        where = (f"  [launch: {r.launch}]" if r.launch else "") + (f"  [{r.note}]" if r.note else "")
        lines.append(f"{r.key:<{width}}{r.action:<8}{r.fingerprint[:12]:<14}{r.reason}{where}")
    runs = sum(r.action == "run" for r in rows)
    lines.append(f"{len(rows)} steps: {runs} run, {len(rows) - runs} reuse")
    return "\n".join(lines)
