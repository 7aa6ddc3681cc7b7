"""The run-wide views: one loss curve over every stage, one eval table over every model.

The `run_report` step is the last step of the smollm3 graph; its inputs are the run's training
stages (`stages`, in training order) and evaluations (`evals`), its config their labels. It writes
into its folder:
- `loss.png`: loss against the optimizer step of the whole run (top axis: tokens), the learning
  rate drawn on a second axis (the one WSD schedule across the pretraining stages, the fresh
  schedules of context extension), stage boundaries marked and named;
- `stages.md`: per stage its steps, tokens, final loss, throughput and MFU with the peak's source;
- `evals.md` / `evals.json`: one row per evaluated model (stages, then post-trained models), one
  column per task, each cell the task's headline metric ± stderr (tasks/evaluate.py), the column
  head naming the metric, the random baseline and the items scored (a cell whose items or
  baseline differ says so), then, per post-trained model, the tasks it moved beyond noise from
  the model its step started from, or a flag that it moved none (also the meta's `moved` and
  `unmoved`).
It publishes them as two Prefect markdown artifacts with stable keys, `<label>-loss-curve` and
`<label>-evals` (label "smollm3": `smollm3-loss-curve`, `smollm3-evals`), and it is cached and
lineage-tracked like every step. `smollm3 summary` and `smollm3 report` (flows/views.py) print
the same table from the same functions over the run's artifacts in lineage.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

from evals.report import eval_rows, eval_table_markdown, eval_table_text, moves, plot_run_loss, stages_markdown
from evals.training_metrics import stage_rows
from pipeline.artifact import Artifact
from pipeline.step import step


class RunReportSpec(BaseModel):
    """The labels of the report's inputs, in input order (what its rows are called)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    stages: tuple[str, ...] = ()  # labels of the `stages` inputs (training order)
    evals: tuple[str, ...] = ()  # labels of the `evals` inputs (stages, then post-trained models)
    # (post-trained model, the model its step started from), as eval labels on the same items:
    # the table flags a step whose scores did not move beyond noise (evals/report.py `moves`)
    parents: tuple[tuple[str, str], ...] = ()

    @model_validator(mode="after")
    def _unique(self) -> RunReportSpec:
        for name, labels in (("stages", self.stages), ("evals", self.evals)):
            if len(set(labels)) != len(labels):
                raise ValueError(f"run report {name} labels repeat: {list(labels)}")
        unknown = sorted({label for pair in self.parents for label in pair} - set(self.evals))
        if unknown:
            raise ValueError(f"run report parents name labels that are no evals: {unknown} (evals: {list(self.evals)})")
        return self


# --- the step ---------------------------------------------------------------------------------


def _labelled(labels: Sequence[str], arts: Sequence[Artifact], name: str) -> list[tuple[str, Artifact]]:
    if len(labels) != len(arts):
        raise ValueError(
            f"run report: {len(arts)} `{name}` inputs but {len(labels)} labels in "
            f"config.{name} ({list(labels)}); the graph must give one label per input"
        )
    return list(zip(labels, arts, strict=True))


def publish_run_report(artifact: Artifact, ws, label: str) -> None:
    """The loss curve (with the stage table) and the eval table as Prefect markdown artifacts
    with stable keys: `<label>-loss-curve`, `<label>-evals`."""
    from prefect.artifacts import create_markdown_artifact

    key = re.sub(r"[^a-z0-9-]+", "-", label.lower()).strip("-")
    folder = artifact.path
    meta = artifact.meta
    markdown = [f"# Loss over the run: {meta['steps']:,} steps, {meta['tokens']:,} tokens", ""]
    png = folder / "loss.png"
    if png.exists():
        markdown.append(f"![loss over the run](data:image/png;base64,{base64.b64encode(png.read_bytes()).decode()})")
    markdown += ["", (folder / "stages.md").read_text(encoding="utf-8")]
    create_markdown_artifact(
        markdown="\n".join(markdown),
        key=f"{key}-loss-curve",
        description="Loss and learning rate over every stage of the run",
    )
    create_markdown_artifact(
        markdown="# Eval scores\n\n" + (folder / "evals.md").read_text(encoding="utf-8"),
        key=f"{key}-evals",
        description="Every model of the run on every task",
    )


@step("run_report", version=1, kind="report", publish=publish_run_report)
def run_report(
    config: RunReportSpec, stages: tuple[Artifact, ...] = (), evals: tuple[Artifact, ...] = (), *, out: Path, log=print
) -> dict[str, Any]:
    """The run's loss curve and eval table (`stages`: the trained stages in order; `evals`: the
    evaluations), labelled by the config."""
    trained = stage_rows(_labelled(config.stages, stages, "stages"))
    rows = eval_rows(_labelled(config.evals, evals, "evals"))
    if trained:
        plot_run_loss(trained, out / "loss.png")
    (out / "stages.md").write_text(stages_markdown(trained) + "\n", encoding="utf-8")
    (out / "evals.md").write_text(eval_table_markdown(rows, config.parents) + "\n", encoding="utf-8")
    (out / "evals.json").write_text(json.dumps(rows, indent=2), encoding="utf-8")
    log("eval scores of the run\n" + eval_table_text(rows, config.parents))
    changes = moves(rows, config.parents)
    steps = sum(s["steps"] for s in trained)
    tokens = sum(s["tokens"] for s in trained)
    final = next((s["metrics"][-1]["loss"] for s in reversed(trained) if s["metrics"]), None)
    return {
        "stages": list(config.stages),
        "models": list(dict.fromkeys(r["model"] for r in rows)),
        "steps": steps,
        "tokens": tokens,
        "final_loss": final,
        # post-training steps whose scores moved beyond noise from their starting model, and not
        "moved": [m["model"] for m in changes if m["moved"]],
        "unmoved": [m["model"] for m in changes if not m["moved"]],
    }
