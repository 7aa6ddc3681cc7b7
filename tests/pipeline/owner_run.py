"""A served run in miniature for tests/pipeline/test_owner.py: a stand-in serve process and the
flow run it owns, as real processes.

    python -m tests.pipeline.owner_run serve STATE   the serve stand-in: names itself the owner
        (pipeline/owner.py `name_owner`), starts the flow process below with its stdout and stderr
        piped to itself (as Prefect's runner does) and reads them into STATE/console.log until it is
        killed
    python -m tests.pipeline.owner_run flow STATE    the flow run: three steps at once, `chatty`
        in this process writing to stdout and stderr every millisecond (as lm-eval's progress bars
        do) until STATE/release appears, `raw_writer` writing to file descriptor 2 the same way,
        and `sleeper` in a child process sleeping a minute

Each step writes STATE/<step>.started when it runs; the flow writes its pid to STATE/flow.pid and
its run id to STATE/run_id.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from pipeline.step import step

REPO = Path(__file__).resolve().parents[2]


class Where(BaseModel):
    """The test's state folder."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    state: str


@step("chatty", version=1, kind="report")
def chatty(config: Where, *, out: Path, log=print) -> dict[str, Any]:
    state = Path(config.state)
    (state / "chatty.started").touch()
    lines = 0
    while not (state / "release").exists():
        if (state / "sleeper.started").exists():  # both run: from now on, a write every millisecond
            sys.stderr.write(f"\r{lines} items scored")  # a progress bar, straight to the console
            sys.stderr.flush()
            print(f"line {lines}", flush=True)
            lines += 1
        time.sleep(0.001)
    log(f"chatty wrote {lines} lines")
    return {"lines": lines}


@step("raw_writer", version=1, kind="report")
def raw_writer(config: Where, *, out: Path, log=print) -> dict[str, Any]:
    """Writes past Python's streams, straight to file descriptor 2: a broken pipe raises here."""
    state = Path(config.state)
    (state / "raw_writer.started").touch()
    while not (state / "release").exists():
        if (state / "sleeper.started").exists():
            os.write(2, b".")
        time.sleep(0.001)
    return {}


@step("sleeper", version=1, kind="report", isolate=True)
def sleeper(config: Where, *, out: Path, log=print) -> dict[str, Any]:
    (Path(config.state) / "sleeper.started").touch()
    time.sleep(60)
    return {"slept": 60}


def serve(state: Path) -> None:
    from pipeline.owner import name_owner

    env = dict(os.environ)
    name_owner(env)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.pipeline.owner_run", "flow", str(state)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    (state / "flow.pid").write_text(str(proc.pid))
    with open(state / "console.log", "wb") as keep:
        for line in proc.stdout:  # read the console (kept for a failing test), until killed
            keep.write(line)
            keep.flush()


def flow(state: Path) -> None:
    run_steps(state, "owner-test", (chatty, raw_writer, sleeper), return_state=True)


def run_steps(state: Path, name: str, steps: tuple, return_state: bool = False) -> Any:
    """One run of a real flow `name` over `steps` (each with label `x` and config `Where(state)`);
    the flow writes its run id to STATE/run_id, the workspace is STATE/ws. Also the flow of
    tests/pipeline/sentinel_run.py."""
    from prefect import flow as prefect_flow
    from prefect.runtime import flow_run

    from flows.recipe import load_recipe, run_setup
    from pipeline.graph import Graph
    from pipeline.runner import run_flow

    recipe = load_recipe("tiny", [f"workspace={state / 'ws'}"])

    @prefect_flow(name=name)
    def run() -> Any:
        (state / "run_id").write_text(str(flow_run.id))
        g = Graph(name)
        for s in steps:
            g.add(s, Where(state=str(state)), label="x")
        return run_flow(name, g, run_setup(recipe, "tiny"))

    return run(return_state=return_state)


if __name__ == "__main__":
    # Through the module's importable name, so the steps are the ones a child process imports.
    from tests.pipeline import owner_run

    {"serve": owner_run.serve, "flow": owner_run.flow}[sys.argv[1]](Path(sys.argv[2]))
