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

from pipeline.step import step
from tests.pipeline.owner_run import Where, run_steps


@step("waiter", version=1, kind="report")
def waiter(config: Where, *, out: Path, log=print) -> dict[str, Any]:
    state = Path(config.state)
    (state / "waiter.started").touch()
    while not (state / "release").exists():
        time.sleep(0.05)
    return {"waited": True}


def flow(state: Path) -> None:
    run_steps(state, "sentinel-test", (waiter,))


if __name__ == "__main__":
    from tests.pipeline import sentinel_run  # the step by its importable name

    sentinel_run.flow(Path(sys.argv[1]))
