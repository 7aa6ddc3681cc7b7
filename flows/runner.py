"""Per-run glue between a flow and its steps: workspace, resolved recipe, step states in lineage.

A flow opens a `RunContext`, calls every step through `ctx.run(...)` and gets Artifacts back.
`ctx.run` calls the Prefect task with the workspace's result storage, forces a rerun for steps the
user named in `refresh`, and records the step's state (completed, cached or failed) in lineage,
including for Cached steps whose body never ran.
"""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from functools import cache
from pathlib import Path
from typing import Any

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import deployment as runtime_deployment
from prefect.runtime import flow_run as runtime_flow_run

from infra.artifact import Artifact
from infra.lineage import StepRow
from infra.workspace import Workspace
from tasks.recipe import Recipe, dump_recipe
from tasks.step import results_storage


def _now() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)


@cache
def git_version() -> str:
    """The commit the code runs from (`+dirty` when the tree has changes), for lineage."""
    root = Path(__file__).resolve().parent.parent
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True,
            text=True, timeout=5, check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
            capture_output=True, text=True, timeout=5,
        ).stdout.strip()
        return rev + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


class RunContext:
    """Everything one flow run's steps share."""

    def __init__(
        self,
        flow: str,
        recipe: Recipe,
        recipe_name: str,
        steps: Iterable[str],
        refresh: Sequence[str] = (),
    ):
        self.flow = flow
        self.recipe = recipe
        self.ws = Workspace.at(recipe.workspace, recipe.storage)
        self.lineage = self.ws.lineage()
        self.steps = tuple(steps)
        unknown = sorted(set(refresh) - set(self.steps))
        if unknown:
            raise ValueError(
                f"refresh names unknown step(s) {', '.join(unknown)}; steps of flow {flow!r}: "
                f"{', '.join(self.steps)}"
            )
        self.refresh = frozenset(refresh)
        self.run_id = str(runtime_flow_run.id or uuid.uuid4())
        self.deployment = runtime_deployment.name
        self.recipe_name = recipe_name
        self.records: list[StepRow] = []
        self.last: Artifact | None = None
        # Bad input per data step (rejected/removed/unaccounted counts from artifact meta), so a
        # run's summary shows what was dropped and why, not only the step states.
        self.dropped: dict[str, dict[str, Any]] = {}

    def __enter__(self) -> RunContext:
        run_dir = self.ws.run_dir(self.run_id)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "recipe.yaml").write_text(dump_recipe(self.recipe), encoding="utf-8")
        self.lineage.start_run(
            self.run_id, self.flow, self.deployment, self.recipe_name,
            self.recipe.model_dump(mode="json"),
        )
        get_run_logger().info(
            f"run {self.run_id}: recipe {self.recipe_name!r}, workspace {self.ws.root}, "
            f"resolved recipe saved to {run_dir / 'recipe.yaml'}"
        )
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.lineage.end_run(self.run_id, "failed" if exc_type else "completed")

    def run(
        self,
        task: Any,
        config: Any,
        inputs: Sequence[Artifact] = (),
        label: str = "",
        params: dict[str, Any] | None = None,
    ) -> Artifact:
        """Run one step and record its state; raises the step's error if it failed."""
        name = task.definition.name
        refresh = name in self.refresh
        started = _now()
        state = task.with_options(
            result_storage=results_storage(self.ws), refresh_cache=refresh or None
        )(
            ws=self.ws, config=config, inputs=tuple(inputs), label=label, refresh=refresh,
            params=params or {}, return_state=True,
        )
        ended = _now()
        code = f"{git_version()}/{task.definition.code_version}"
        if state.is_completed():
            artifact: Artifact = state.result()
            row_state = "cached" if state.name == "Cached" else "completed"
            self._record(name, label, artifact.fingerprint, row_state, config, code, started, ended)
            self.last = artifact
            counts = {k: artifact.meta[k] for k in ("rejected", "removed", "unaccounted") if artifact.meta.get(k)}
            if counts:
                self.dropped[f"{name}[{label}]"] = counts
            return artifact
        error = str(state.message or state.name)
        fp = task.definition.fingerprint(config, tuple(inputs), params or {})
        self._record(name, label, fp, "failed", config, code, started, ended, error)
        state.result()  # raises the task's exception
        raise RuntimeError(f"step {name}[{label}] ended in state {state.name}: {error}")

    def _record(self, name, label, fp, state, config, code, started, ended, error=None) -> None:
        row = StepRow(
            self.run_id, name, label, fp, state,
            config.model_dump(mode="json") if hasattr(config, "model_dump") else config,
            code, started, ended, error,
        )
        self.records.append(row)
        self.lineage.record_step(row)

    def summary(self) -> dict[str, Any]:
        """Steps and states of this run, also published as a markdown artifact in the UI."""
        rows = [
            f"| {r.step} | {r.label} | {r.state} | `{(r.fingerprint or '')[:12]}` | "
            f"{(r.ended - r.started).total_seconds():.1f} |"
            for r in self.records
        ]
        markdown = "\n".join(
            [
                f"# {self.flow} run `{self.run_id}`",
                f"Recipe `{self.recipe_name}`, workspace `{self.ws.root}`.",
                "",
                "| step | label | state | fingerprint | seconds |",
                "|---|---|---|---|---|",
                *rows,
                *(["", "## Dropped input", "", "| step | counts |", "|---|---|"] if self.dropped else []),
                *(f"| {k} | {v} |" for k, v in self.dropped.items()),
            ]
        )
        create_markdown_artifact(markdown=markdown, key=f"{self.flow}-summary", description="Steps and states")
        states: dict[str, int] = {}
        for r in self.records:
            states[r.state] = states.get(r.state, 0) + 1
        return {
            "run_id": self.run_id,
            "workspace": self.ws.root,
            "states": states,
            "final": self.last.model_dump(mode="json") if self.last else None,
            "dropped": self.dropped,
        }
