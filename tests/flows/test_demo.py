"""What `make demo` prints while a run goes: one line per step state change and the running
step's progress, read from a real Prefect API while the flow runs."""

from __future__ import annotations

import queue
import threading
import time
from pathlib import Path

from prefect import flow
from pydantic import BaseModel, ConfigDict

from flows.recipe import load_recipe, run_setup
from flows.watch import watch
from pipeline.graph import Graph
from pipeline.lineage import Lineage
from pipeline.runner import run_flow
from pipeline.step import step
from tests.pipeline.test_runner import Flaky, _attempt


class Gate(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    release: str  # the step waits at 50% until this file exists


@step("flaky_slow", version=1, kind="report", retries=1, retry_delay=1)
def flaky_slow(config: Flaky, *, out: Path, log=print) -> dict:
    return _attempt(config)


@step("gated", version=1, kind="report")
def gated(config: Gate, *, out: Path, log=print, progress=None) -> dict:
    progress(50.0)
    deadline = time.monotonic() + 60
    while not Path(config.release).exists():
        if time.monotonic() > deadline:
            raise TimeoutError("the watcher never saw 50%")
        time.sleep(0.1)
    progress(100.0)
    return {}


def test_watch_prints_state_changes_and_progress_not_events(tmp_path, prefect_harness):
    from prefect.runtime import flow_run as runtime_flow_run

    recipe = load_recipe("tiny", [f"workspace={tmp_path / 'ws'}"])
    release = tmp_path / "release"
    ids: queue.Queue = queue.Queue()

    @flow(name="watch-test")
    def run() -> dict:
        ids.put(runtime_flow_run.id)
        g = Graph("watch-test")
        first = g.add(flaky_slow, Flaky(counter=str(tmp_path / "n"), fail_times=1, error="eio"), label="x")
        g.add(gated, Gate(release=str(release)), label="stage1", after=[first])
        return run_flow("watch-test", g, run_setup(recipe, "tiny"))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    lines: list[str] = []

    def out(line: str) -> None:
        lines.append(line)
        if "gated[stage1]" in line and "50.0%" in line:
            release.touch()  # let the step finish once the watcher has shown its progress

    final, _ = watch(ids.get(timeout=60), poll=0.2, out=out, lineage=Lineage(tmp_path / "ws" / "lineage.duckdb"))
    thread.join(timeout=60)
    text = "\n".join(lines)
    print(text)  # what a user sees (pytest -s)
    assert final == "Completed", text
    assert all(line.startswith("[demo] ") for line in lines)
    steps = [line.split()[2:4] for line in lines if "flaky_slow[x]" in line or "gated[stage1]" in line]
    # a retry a second later: shown once, with its cause, and the completed line counts it
    (retrying,) = [line for line in lines if "flaky_slow[x]" in line and " retrying " in line]
    assert "OSError: [Errno 5]" in retrying
    assert next(line for line in lines if "flaky_slow[x]" in line and "Completed" in line).endswith("(after 1 retry)")
    assert (
        steps.index(["gated[stage1]", "Running"])
        < steps.index(["gated[stage1]", "50.0%"])
        < steps.index(["gated[stage1]", "Completed"])
    )
    assert lines[-1].endswith("flow run Completed")
    assert "prefect." not in text  # no raw event names
    assert len(lines) < 15  # a line per change, not a stream
