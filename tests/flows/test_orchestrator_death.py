"""A served run whose serve and flow processes are SIGKILLed together is seen dead in seconds: the
run is Crashed and its running steps recorded `stopped` within 60 s, and `prefect flow-run retry`
works at once (pipeline/sentinel.py).

The real thing, driven from outside: `python -m flows.deployments` and `prefect deployment run
smollm3/full` on the data part of the tiny recipe (the cheapest served run: its first steps, the
sources, run in child processes, two at once in the `data` slots, the third waiting for a slot),
in a copy of the session's finished data part whose source folders are deleted (the sources build
again; their curations, tokenizer and shards are reused by fingerprint).
Once the first source steps build, their child processes are frozen (SIGSTOP) so that they are
certainly still running when the serve and flow process groups are SIGKILLed; what Prefect shows
running at that moment is what lineage must then show stopped. A new serve process and `prefect
flow-run retry` then run the same flow run to its end.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from pipeline.lineage import Lineage
from tests.conftest import DATA_ONLY

REPO = Path(__file__).resolve().parents[2]
PREFECT = str(Path(sys.executable).parent / "prefect")


def _serve(tmp_path: Path, env: dict[str, str], n: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "flows.deployments"],
        cwd=REPO,
        env=env,
        stdout=open(tmp_path / f"serve{n}.log", "wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _flow_run(run_id: str):
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(run_id)


def _task_runs(run_id: str) -> dict[str, str]:
    """Each task run of the flow run by name (`source[prose]`), with its state type."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id])))
    return {r.name: r.state.type.value for r in runs if r.state is not None}


def _step_children(serve: psutil.Process) -> list[psutil.Process]:
    """The child processes building steps (`python -u -m pipeline.child -`, under their guards)."""
    found = []
    for p in serve.children(recursive=True):
        try:
            if p.cmdline()[1:4] == ["-u", "-m", "pipeline.child"]:
                found.append(p)
        except psutil.Error:
            continue
    return found


def _kill_tree(procs: list[psutil.Process]) -> None:
    for p in procs:
        try:
            p.send_signal(signal.SIGCONT)
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=30)


@pytest.mark.slow
def test_killed_serve_and_flow_processes_are_seen_in_seconds_and_the_run_retries(
    tmp_path, private_api_url, workspace_copy
):
    # A copy of the session's data part (tests/conftest.py) without its source folders: the
    # sources build again (the steps frozen and killed here), the rest is reused by fingerprint.
    ws = workspace_copy("data")
    shutil.rmtree(ws / "source")
    env = {**os.environ, "PREFECT_API_URL": private_api_url}
    serve = _serve(tmp_path, env, 1)
    frozen: list[psutil.Process] = []
    serve2 = None
    try:
        params = json.dumps({"recipe": "tiny", "overrides": [*DATA_ONLY, f"workspace={ws}"]})
        for _ in range(120):  # until serve has registered the deployment
            res = subprocess.run(
                [PREFECT, "deployment", "run", "smollm3/full", "--params", params],
                env=env,
                capture_output=True,
                text=True,
            )
            if res.returncode == 0:
                break
            time.sleep(1)
        run_id = next(ln.split("UUID:")[1].strip() for ln in res.stdout.splitlines() if "UUID:" in ln)

        # the first steps build: freeze them, so they are still running at the kill
        deadline = time.monotonic() + 400
        root = psutil.Process(serve.pid)
        while len(frozen) < 2:
            assert time.monotonic() < deadline, f"no two steps built; run {_flow_run(run_id).state}"
            for child in _step_children(root):
                if child not in frozen:
                    child.send_signal(signal.SIGSTOP)
                    frozen.append(child)
            time.sleep(0.1)
        time.sleep(1.0)  # a step that had just entered shows in Prefect too
        running = {name for name, state in _task_runs(run_id).items() if state == "RUNNING"}
        (flow,) = [p for p in root.children() if p.environ().get("PREFECT__FLOW_RUN_ID") == run_id]
        groups = {os.getpgid(serve.pid), os.getpgid(flow.pid)}
        for group in groups:
            os.killpg(group, signal.SIGKILL)
        killed = time.monotonic()
        print(
            f"SIGKILL process groups {sorted(groups)} (serve {serve.pid}, flow {flow.pid}); running: {sorted(running)}"
        )
        serve.wait()

        while not (state := _flow_run(run_id).state).is_crashed():
            assert time.monotonic() - killed < 60, f"still {state.type.value} 60s after the kill"
            time.sleep(0.25)
        seen = time.monotonic() - killed
        lineage = Lineage(ws / "lineage.duckdb")
        rows = {f"{r['step']}[{r['label']}]": r for r in lineage.steps_of(run_id)}
        while not running <= set(rows) and time.monotonic() - killed < 60:
            time.sleep(0.25)
            rows = {f"{r['step']}[{r['label']}]": r for r in lineage.steps_of(run_id)}
        recorded = time.monotonic() - killed
        print(
            f"Crashed {seen:.1f}s and running steps recorded {recorded:.1f}s after the SIGKILL "
            f"(load {os.getloadavg()[0]:.1f}): {state.message}"
        )
        assert recorded < 60
        assert f"prefect flow-run retry {run_id}" in state.message, state.message
        stopped = {k for k, r in rows.items() if r["state"] == "failed"}
        waiting = {k for k, r in rows.items() if r["state"] == "skipped"}
        assert stopped | waiting == running, rows
        assert len(stopped) == len(frozen), (rows, frozen)  # the frozen builds, by the flow's own count
        for key in stopped:
            assert rows[key]["error"].startswith("stopped: the flow-run process (pid "), rows[key]
            assert "the run's sentinel (pid" in rows[key]["error"], rows[key]
        for key in waiting:
            assert rows[key]["error"].startswith("not started: the flow-run process (pid "), rows[key]
        assert "Stopped while running: " + ", ".join(sorted(stopped)) in state.message, state.message
        # no step left running in the UI within the same 60 s (the server records task runs
        # from events, seconds late under load: the sentinel sets them until Prefect holds it)
        while "RUNNING" in (task_runs := _task_runs(run_id)).values() and time.monotonic() - killed < 60:
            time.sleep(0.5)
        assert "RUNNING" not in task_runs.values(), task_runs
        assert [a["state"] for a in lineage.attempts_of(run_id)] == ["crashed"]
        _, alive = psutil.wait_procs(frozen, timeout=30)  # the guards end the frozen builds
        assert not alive, alive

        # retry at once: the run is terminal; a new serve process runs it to its end
        serve2 = _serve(tmp_path, env, 2)
        retry = subprocess.run([PREFECT, "flow-run", "retry", run_id], env=env, capture_output=True, text=True)
        assert retry.returncode == 0, retry.stdout + retry.stderr
        deadline = time.monotonic() + 900
        while (state := _flow_run(run_id).state).type.value not in {"COMPLETED", "FAILED", "CRASHED"} or (
            state.is_crashed() and _flow_run(run_id).run_count < 2
        ):
            assert time.monotonic() < deadline, f"the retried run is still {state.type.value}"
            time.sleep(2)
        assert state.is_completed(), state.message
        assert [a["state"] for a in lineage.attempts_of(run_id)] == ["crashed", "completed"]
        again = [r for r in lineage.steps_of(run_id) if r["attempt"] == 2]
        assert running <= {f"{r['step']}[{r['label']}]" for r in again if r["state"] == "completed"}, again
    finally:
        _kill_tree(frozen)
        for proc in (serve, serve2):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
