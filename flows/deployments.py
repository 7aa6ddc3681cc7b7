"""Serve every deployment of the project from one long-running process.

    python -m flows.deployments          (what `make demo` starts; `smollm3 serve` does the same)

Each deployment carries an explicit concurrency limit: `serve()` has none unless given one, and two
full runs on one machine would fight over its cores and the same workspace.
`pause_on_shutdown=False` keeps schedules active when this process stops, so a restart of the serve
process does not silently disable them.
"""

from __future__ import annotations

from prefect import serve
from prefect.deployments.runner import RunnerDeployment

from flows.smollm3 import smollm3


def deployments() -> list[RunnerDeployment]:
    return [
        smollm3.to_deployment(
            name="full",
            description="The whole SmolLM3 DAG on a recipe (default: the tiny CPU recipe).",
            parameters={"recipe": "tiny", "overrides": [], "refresh": []},
            concurrency_limit=1,
            tags=["smollm3"],
        ),
    ]


def main() -> None:
    serve(*deployments(), pause_on_shutdown=False, limit=2)


if __name__ == "__main__":
    main()
