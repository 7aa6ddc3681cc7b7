"""Plain-text views of lineage for the CLI: ancestor trees, run listings, the demo summary."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from infra.artifact import find_marker
from infra.lineage import Lineage


def _facts(meta: Any, limit: int = 5) -> str:
    if isinstance(meta, str):
        meta = json.loads(meta)
    scalars = [
        f"{k}={v}" for k, v in (meta or {}).items()
        if isinstance(v, int | float) or (isinstance(v, str) and len(v) <= 40)
    ]
    return " ".join(scalars[:limit])


def _line(row: dict[str, Any]) -> str:
    label = f"[{row['label']}]" if row.get("label") else ""
    return (
        f"{row['kind']} {row['fingerprint'][:12]}  {row['step']}{label}  {row['uri']}  "
        f"{_facts(row['meta'])}".rstrip()
    )


def resolve_artifact(lineage: Lineage, ref: str) -> dict[str, Any]:
    """An artifact row from a fingerprint (or prefix) or a path inside a step folder."""
    path = Path(ref)
    if path.exists():
        row = lineage.artifact_by_uri(path)
        if row is None:
            record = find_marker(path)
            if record is not None:
                row = lineage.artifact(record["artifact"]["fingerprint"])
        if row is None:
            raise LookupError(f"{ref} is not inside any step folder recorded in {lineage.path}")
        return row
    if len(ref) < 4 or any(c not in "0123456789abcdef" for c in ref.lower()):
        raise LookupError(f"{ref!r} is neither an existing path nor a fingerprint prefix")
    row = lineage.artifact(ref.lower())
    if row is None:
        raise LookupError(f"no artifact with fingerprint {ref!r} in {lineage.path}")
    return row


def tree(lineage: Lineage, root: dict[str, Any], descendants: bool = False) -> str:
    """The ancestor (or descendant) tree of one artifact, one line per artifact."""
    step = lineage.children if descendants else lineage.parents
    lines = [_line(root)]

    def walk(fp: str, prefix: str, seen: frozenset[str]) -> None:
        rows = step(fp)
        for i, row in enumerate(rows):
            last = i == len(rows) - 1
            lines.append(prefix + ("└── " if last else "├── ") + _line(row))
            if row["fingerprint"] in seen:
                continue
            walk(row["fingerprint"], prefix + ("    " if last else "│   "), seen | {row["fingerprint"]})

    walk(root["fingerprint"], "", frozenset({root["fingerprint"]}))
    return "\n".join(lines)


def runs_table(lineage: Lineage, limit: int = 20, steps: bool = True) -> str:
    out = []
    for run in lineage.runs(limit):
        ended = run["ended"].strftime("%H:%M:%S") if run["ended"] else "-"
        out.append(
            f"{run['run_id']}  {run['flow']}/{run['deployment'] or '-'}  recipe={run['recipe']}  "
            f"{run['state']}  started {run['started']:%Y-%m-%d %H:%M:%S}  ended {ended}"
        )
        if steps:
            for s in lineage.steps_of(run["run_id"]):
                label = f"[{s['label']}]" if s["label"] else ""
                err = f"  {s['error'][:120]}" if s["error"] else ""
                out.append(
                    f"    {s['step']}{label:<14} {s['state']:<9} {(s['fingerprint'] or '')[:12]}  "
                    f"{s['seconds']:.1f}s{err}"
                )
    return "\n".join(out) if out else f"no runs recorded in {lineage.path}"


def summary(lineage: Lineage, ui_url: str | None) -> str:
    """What `make demo` prints at the end: the newest run, its steps, the newest artifact's lineage."""
    runs = lineage.runs(1)
    if not runs:
        return f"no runs recorded in {lineage.path}"
    run = runs[0]
    parts = ["== newest run ==", runs_table(lineage, 1)]
    newest = lineage.query_dicts(
        "SELECT a.* FROM steps s JOIN artifacts a ON a.fingerprint = s.fingerprint "
        "WHERE s.run_id = ? AND s.state <> 'failed' ORDER BY s.ended DESC LIMIT 1",
        [run["run_id"]],
    )
    if newest:
        parts += ["", "== lineage of the newest artifact ==", tree(lineage, newest[0])]
    parts += ["", "== where to look =="]
    if ui_url:
        parts.append(f"Prefect UI:   {ui_url}/runs/flow-run/{run['run_id']}")
    parts.append(f"lineage:      smollm3 lineage <fingerprint|path>   (DuckDB file {lineage.path})")
    parts.append("runs:         smollm3 runs")
    return "\n".join(parts)
