"""A flow-run process for tests/pipeline/test_sentinel.py: one run of a real flow with one step.

    python -m tests.pipeline.sentinel_run STATE

The step `waiter` writes STATE/waiter.started and waits (in the flow process) until STATE/release
appears; the flow writes its run id to STATE/run_id. The workspace is STATE/ws.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from pipeline.step import step


class Where(BaseModel):
    """The test's state folder."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    state: str


@step("waiter", version=1, kind="report")
def waiter(config: Where, *, out: Path, log=print) -> dict[str, Any]:
    state = Path(config.state)
    (state / "waiter.started").touch()
    while not (state / "release").exists():
        time.sleep(0.05)
    return {"waited": True}


def flow(state: Path) -> None:
    from prefect import flow as prefect_flow
    from prefect.runtime import flow_run

    from flows.recipe import load_recipe, run_setup
    from pipeline.graph import Graph
    from pipeline.runner import run_flow

    recipe = load_recipe("tiny", [f"workspace={state / 'ws'}"])

    @prefect_flow(name="sentinel-test")
    def run() -> Any:
        (state / "run_id").write_text(str(flow_run.id))
        g = Graph("sentinel-test")
        g.add(waiter, Where(state=str(state)), label="x")
        return run_flow("sentinel-test", g, run_setup(recipe, "tiny"))

    run()


if __name__ == "__main__":
    from tests.pipeline import sentinel_run  # the step by its importable name

    sentinel_run.flow(Path(sys.argv[1]))
