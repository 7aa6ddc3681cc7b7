"""pipeline/sentinel.py: a flow-run process that dies without closing its run is marked Crashed, its
running step `stopped`, within seconds; one that is only slow (stopped with SIGSTOP, as a starved
process on a loaded machine is) is never marked, and its sentinel leaves with it.

Real processes: a flow run of a real flow (tests/pipeline/sentinel_run.py) in a process of its
own, against the session's Prefect server, signalled from outside. The served run (the serve and
flow process groups SIGKILLed, then `prefect flow-run retry`) is tests/flows/test_orchestrator_death.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from pipeline.lineage import Lineage
from pipeline.sentinel import TASK_RUN_WAIT_S

REPO = Path(__file__).resolve().parents[2]


def _start(tmp_path: Path, api_url: str) -> tuple[subprocess.Popen, psutil.Process]:
    """The flow process, once its step runs, and its sentinel."""
    flow = subprocess.Popen(
        [sys.executable, "-m", "tests.pipeline.sentinel_run", str(tmp_path)],
        cwd=REPO,
        env={**os.environ, "PREFECT_API_URL": api_url, "PYTHONPATH": str(REPO)},
        stdout=open(tmp_path / "flow.log", "wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + 180
    while not (tmp_path / "waiter.started").exists():
        log = (tmp_path / "flow.log").read_text(errors="replace")[-3000:]
        assert flow.poll() is None and time.monotonic() < deadline, f"the step did not start:\n{log}"
        time.sleep(0.1)
    (sentinel,) = [p for p in psutil.Process(flow.pid).children() if "pipeline.sentinel" in p.cmdline()]
    assert os.getsid(sentinel.pid) != os.getsid(flow.pid), "the sentinel shares the flow's session"
    return flow, sentinel


def _state(run_id: str):
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(run_id).state


@pytest.mark.slow
def test_a_frozen_flow_process_is_not_crashed_and_its_sentinel_leaves_with_the_run(tmp_path, api_url):
    flow, sentinel = _start(tmp_path, api_url)
    try:
        run_id = (tmp_path / "run_id").read_text()
        os.kill(flow.pid, signal.SIGSTOP)  # not scheduled at all: slower than any loaded machine
        time.sleep(12)  # a dozen of the sentinel's looks
        assert _state(run_id).is_running()
        assert sentinel.is_running()
        os.kill(flow.pid, signal.SIGCONT)
        (tmp_path / "release").touch()
        assert flow.wait(180) == 0, (tmp_path / "flow.log").read_text(errors="replace")[-3000:]
    finally:
        if flow.poll() is None:
            os.kill(flow.pid, signal.SIGCONT)
        (tmp_path / "release").touch()
        flow.wait(180)
    assert _state(run_id).is_completed()
    psutil.wait_procs([sentinel], timeout=15)
    assert not sentinel.is_running(), "the sentinel outlived its closed run"
    lineage = Lineage(tmp_path / "ws" / "lineage.duckdb")
    assert [(r["step"], r["state"]) for r in lineage.steps_of(run_id)] == [("waiter", "completed")]
    assert [a["state"] for a in lineage.attempts_of(run_id)] == ["completed"]
    assert sorted(p.name for p in (tmp_path / "ws" / "runs" / run_id).iterdir()) == ["recipe.yaml"]


@pytest.mark.slow
def test_a_sigkilled_flow_process_is_crashed_in_seconds_with_its_running_step_stopped(tmp_path, api_url):
    flow, sentinel = _start(tmp_path, api_url)
    run_id = (tmp_path / "run_id").read_text()
    try:
        os.killpg(flow.pid, signal.SIGKILL)
        killed = time.monotonic()
        flow.wait()
        while not (state := _state(run_id)).is_crashed():
            assert time.monotonic() - killed < 60, f"still {state.type.value} 60s after the kill"
            time.sleep(0.25)
        seen = time.monotonic() - killed
        print(f"Crashed {seen:.1f}s after SIGKILL (load {os.getloadavg()[0]:.1f})")
    finally:
        (tmp_path / "release").touch()
    assert "the flow-run process (pid" in state.message and "Stopped while running: waiter[x]" in state.message
    assert f"prefect flow-run retry {run_id}" in state.message
    lineage = Lineage(tmp_path / "ws" / "lineage.duckdb")
    (row,) = lineage.steps_of(run_id)
    assert row["state"] == "failed", row
    assert row["error"].startswith(f"stopped: the flow-run process (pid {flow.pid}) of this run died"), row
    assert f"the run's sentinel (pid {sentinel.pid})" in row["error"], row
    assert [a["state"] for a in lineage.attempts_of(run_id)] == ["crashed"]
    # It may keep setting the step's task run Crashed for up to TASK_RUN_WAIT_S: a task run whose
    # events the killed process never sent reaches the server late or never.
    psutil.wait_procs([sentinel], timeout=TASK_RUN_WAIT_S + 30)
    said = (tmp_path / "ws" / "runs" / run_id / "sentinel-1.log").read_text()
    assert not sentinel.is_running(), f"the sentinel outlived the run it reported:\n{said}"
    assert "marked Crashed" in said, said
