"""The `compare` step: every run's scores of an experiment to its trusted tasks and comparisons.

Its inputs are named by run (`{label}.lm`: lm-eval artifacts in step order; `{label}.heldout`:
held-out BPB artifacts, one point per evaluated checkpoint; `base`: an anneal's pinned
checkpoint); reading their scores (`collect`), the statistics, the report and the chart are
evals/experiments.py's. The publish hook writes DuckDB `experiments`, `experiment_runs` and
`experiment_results` and the Prefect table and markdown artifacts.
"""

from __future__ import annotations

import json
import math
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from evals.experiments import ExperimentSpec, chart, collect, compare_variants, report_markdown, task_quality
from pipeline.artifact import Artifact
from pipeline.step import step


def _json_safe(value: Any) -> Any:
    """inf/nan are not JSON (the meta lands in DuckDB JSON columns): null instead; the markdown
    report keeps them."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def publish_experiment(artifact: Artifact, ws, label: str) -> None:
    """The experiment to DuckDB (`experiments`, `experiment_runs`, `experiment_results`), the
    comparison as a Prefect table and the report with its chart as a markdown artifact."""
    import base64

    from prefect.artifacts import create_markdown_artifact, create_table_artifact
    from prefect.runtime import flow_run

    now = datetime.now(UTC).replace(tzinfo=None)
    meta, exp_id = artifact.meta, artifact.fingerprint
    base = meta.get("base") or {}
    experiment = {
        "experiment": exp_id,
        "run_id": str(flow_run.id) if flow_run.id else None,
        "kind": meta["kind"],
        "name": meta["name"],
        "baseline": meta["baseline"],
        "variants": json.dumps(meta["variants"]),
        "seeds": json.dumps(meta["seeds"]),
        "confidence": meta["confidence"],
        "trusted": json.dumps(meta["trusted"]),
        "quality": json.dumps(meta["quality"]),
        "base_checkpoint": base.get("source"),
        "base_global_step": base.get("global_step"),
        "created": now,
    }
    points = json.loads((artifact.path / "points.json").read_text())
    runs = [{"experiment": exp_id, **p} for p in points]
    results = [
        {"experiment": exp_id, "created": now, **{k: v for k, v in r.items() if k != "eval_fingerprint"}}
        for r in meta["rows"]
    ]
    ws.lineage().record_experiment(experiment, runs, results)
    key = re.sub(r"[^a-z0-9-]+", "-", f"{meta['kind']}-comparison-{label}".lower())
    table = [
        {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items() if k != "eval_fingerprint"}
        for r in meta["rows"]
    ]
    create_table_artifact(
        table=table, key=key, description=f"{meta['kind']} {meta['name']}: variants vs {meta['baseline']}"
    )
    markdown = (artifact.path / "comparison.md").read_text()
    png = artifact.path / "comparison.png"
    if png.exists():
        markdown += f"\n![scores over training](data:image/png;base64,{base64.b64encode(png.read_bytes()).decode()})\n"
    create_markdown_artifact(
        markdown=markdown,
        key=re.sub(r"[^a-z0-9-]+", "-", f"{meta['kind']}-report-{label}".lower()),
        description=f"{meta['kind']} {meta['name']}: trusted evals, comparison and curves",
    )


@step("compare", version=1, kind="report", publish=publish_experiment)
def compare(
    config: ExperimentSpec, *, out: Path, log=print, **inputs: Artifact | tuple[Artifact, ...]
) -> dict[str, Any]:
    """Every run's scores (inputs named by run: `{label}.lm`, its lm-eval artifacts in step
    order; `{label}.heldout`, its held-out BPB artifacts; `base`, an anneal's pinned checkpoint)
    assessed, compared and reported (see the module docstring): the trusted tasks and the
    comparison of each variant with the baseline."""
    missing = sorted({f"{r.label}.{k}" for r in config.runs for k in ("lm", "heldout")} - set(inputs))
    if missing:
        raise ValueError(f"compare: no input(s) {', '.join(missing)}")
    tasks = collect(config, inputs)
    partial = sorted(n for n, t in tasks.items() if len(t.points) != len(config.runs))
    if partial:
        log(f"not compared (not scored in every run): {', '.join(partial)}")
    quality = task_quality(config, tasks)
    if not quality:
        raise ValueError(f"compare: no task was scored in every run of {config.name}")
    rows = compare_variants(config, tasks, quality)
    seeds = {v: sum(r.variant == v for r in config.runs) for v in config.variants}
    base = dict(inputs["base"].meta) if isinstance(inputs.get("base"), Artifact) else None
    markdown = report_markdown(config, quality, rows, seeds, base)
    (out / "comparison.md").write_text(markdown)
    (out / "comparison.json").write_text(json.dumps(rows, indent=2))
    by_label = {r.label: r for r in config.runs}
    points = [
        {
            "label": lb,
            "variant": by_label[lb].variant,
            "seed": by_label[lb].seed,
            "task": name,
            "metric": t.metric,
            "step": p[0],
            "value": p[1],
            "stderr": p[2],
            "eval_fingerprint": p[3],
        }
        for name, t in sorted(tasks.items())
        for lb, pts in t.points.items()
        for p in pts
    ]
    (out / "points.json").write_text(json.dumps(points))
    drawn = chart(config, tasks, quality, out / "comparison.png")
    log("\n" + markdown)
    t = config.trust
    return _json_safe(
        {
            "kind": config.kind,
            "name": config.name,
            "baseline": config.baseline,
            "variants": dict(config.variants),
            "seeds": seeds,
            "confidence": config.confidence,
            "rows": rows,
            "base": base,
            "trusted": sorted(n for n, q in quality.items() if q.trusted(t.require)),
            "quality": {
                n: {
                    "points": q.points,
                    "final": q.final,
                    "spearman": q.spearman,
                    "snr": q.snr,
                    "margin": q.margin,
                    "kendall": q.kendall,
                    "checks": q.checks,
                    "better": q.better,
                    "noise": q.noise_source,
                    "trusted": q.trusted(t.require),
                    "why": q.reasons(t.thresholds, t.require),
                }
                for n, q in sorted(quality.items())
            },
            "not_compared": partial,
            "chart": drawn,
        }
    )
