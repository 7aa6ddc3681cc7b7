"""Task runs carry their `step[label]` names from the start (pipeline/named_runs.py), read back
through the Prefect API while the steps they wait for still run."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner
from pydantic import BaseModel, ConfigDict

from flows.recipe import load_recipe, run_setup
from pipeline.graph import Graph
from pipeline.named_runs import NamedTaskRunner
from pipeline.runner import run_flow
from pipeline.step import step


class Gate(BaseModel):
    """A file the first step waits for (the test creates it once it has looked)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    release: str


@step("held", version=1, kind="report")
def held(config: Gate, *, out: Path, log=print) -> dict[str, Any]:
    deadline = time.monotonic() + 120
    while not Path(config.release).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return {}


@step("waits", version=1, kind="report")
def waits(config: Gate, *, out: Path, log=print) -> dict[str, Any]:
    return {}


def _task_runs(run_id: str) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        return client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id])))


def _pending_names(tmp_path: Path, runner) -> tuple[dict[str, str], dict[str, Any]]:
    """Run held[x] -> waits[x], waits[y] under `runner`; while held[x] runs, the API's task runs
    (name -> state) and their rows."""
    release = tmp_path / "release"
    recipe = load_recipe("tiny", [f"workspace={tmp_path / 'ws'}"])
    seen: dict[str, Any] = {}

    @flow(name="named-runs-test", task_runner=runner)
    def named() -> dict:
        from prefect.runtime import flow_run

        seen["run_id"] = str(flow_run.id)
        g = Graph("named-runs-test")
        first = g.add(held, Gate(release=str(release)), label="x")
        g.add(waits, Gate(release=str(release)), label="x", after=[first])
        g.add(waits, Gate(release=str(tmp_path / "other")), label="y", after=[first])
        return run_flow("named-runs-test", g, run_setup(recipe, "tiny"))

    def look() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if "run_id" in seen:
                runs = _task_runs(seen["run_id"])
                # every row with its first state (a row is created a moment before its state is set)
                if len(runs) == 3 and all(r.state for r in runs) and any(r.state.is_running() for r in runs):
                    seen["rows"] = {r.name: r for r in runs}
                    break
            time.sleep(0.2)
        release.touch()

    watcher = threading.Thread(target=look, daemon=True)
    watcher.start()
    named()
    watcher.join()
    rows = seen.get("rows") or {}
    return {name: r.state.name for name, r in rows.items()}, rows


def test_pending_task_runs_carry_their_step_names_in_the_api(tmp_path, prefect_harness):
    states, rows = _pending_names(tmp_path / "named", NamedTaskRunner())
    assert states == {"held[x]": "Running", "waits[x]": "Pending", "waits[y]": "Pending"}, states
    # The edges the UI draws are still the graph's: each waiting run names the one it waits for.
    gate = rows["held[x]"].id
    for key in ("waits[x]", "waits[y]"):
        assert {i.id for i in rows[key].task_inputs["gates"]} == {gate}, rows[key].task_inputs
    # Prefect's own runner, for contrast: the pending runs are `waits-<3 characters>`.
    states, _ = _pending_names(tmp_path / "stock", ThreadPoolTaskRunner())
    pending = sorted(name for name, state in states.items() if state == "Pending")
    assert len(pending) == 2 and all(name.startswith("waits-") and len(name) == 9 for name in pending), states


def test_the_project_flows_run_their_tasks_under_the_named_runner():
    from flows import prefect_flows

    for pf in (prefect_flows.smollm3, prefect_flows.anneal, prefect_flows.cpt, prefect_flows.ablation):
        assert isinstance(pf.task_runner, NamedTaskRunner), pf.name


def test_a_served_flow_is_loaded_from_where_its_deployment_points():
    """A served deployment's entrypoint is where the flow-run process loads the flow from: it must
    name the module that holds the flow under its own name (flows/prefect_flows.py), never the flow
    module whose function it wraps (where no attribute of that name exists)."""
    from prefect.flows import load_flow_from_entrypoint

    from flows import prefect_flows

    for pf in (prefect_flows.smollm3, prefect_flows.anneal, prefect_flows.cpt, prefect_flows.ablation):
        deployment = pf.to_deployment(name="entrypoint-test")
        assert deployment.entrypoint == f"flows/prefect_flows.py:{pf.name}", deployment.entrypoint
        assert load_flow_from_entrypoint(deployment.entrypoint).name == pf.name
