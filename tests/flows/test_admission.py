"""Runs are refused before anything starts (flows/admission.py): `smollm3 run` before it touches
Prefect, a served deployment's run before it waits for its concurrency slot (through the API)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from flows.admission import ScheduledRunCheck, check_run, watch_scheduled_runs

REPO = Path(__file__).resolve().parents[2]
BAD = {
    "tny": "no recipe 'tny'",
    "tiny stages.stage9.tokens=1": "no item named 'stage9'",
    "tiny training.optimizer.lrr=0.001": "training.optimizer.lrr: unknown field",
}


@pytest.mark.parametrize("argv", sorted(BAD))
def test_smollm3_run_refuses_a_bad_recipe_at_once_without_prefect(argv, tmp_path):
    """No server, no Prefect import: the error `plan` gives, in the time `plan` takes."""
    code = (
        "import json, sys\nfrom flows.cli import main\n"
        "rc = main(sys.argv[1:])\n"
        "print(json.dumps({'rc': rc, 'prefect': 'prefect' in sys.modules}))"
    )
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", code, "run", *argv.split()],
        capture_output=True,
        text=True,
        env={**env, "SMOLLM3_HOME": str(tmp_path), "PYTHONPATH": str(REPO)},
        cwd=REPO,
        timeout=300,
    )
    seconds = time.monotonic() - started
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"rc": 2, "prefect": False}, done.stderr
    assert done.stderr.startswith("smollm3 run: error:") and BAD[argv] in done.stderr, done.stderr
    plan = subprocess.run(
        [sys.executable, "-m", "flows.cli", "plan", *argv.split()],
        capture_output=True,
        text=True,
        env={**env, "SMOLLM3_HOME": str(tmp_path), "PYTHONPATH": str(REPO)},
        cwd=REPO,
        timeout=300,
    )
    assert plan.stderr.replace("smollm3 plan:", "smollm3 run:") == done.stderr  # the same message
    assert seconds < 120, f"took {seconds:.0f}s"  # seconds even under load, not a server start-up


def test_the_checks_are_the_flows_own():
    check_run("smollm3", {"recipe": "tiny", "overrides": ["stages=[]"], "refresh": []})  # a good run passes
    with pytest.raises(ValueError, match="unknown step"):
        check_run("smollm3", {"recipe": "tiny", "overrides": [], "refresh": ["tokeniser"]})
    with pytest.raises(ValueError, match="training.optimizer.lrr"):
        check_run("anneal", {"recipe": "tiny", "overrides": ["training.optimizer.lrr=1"], "base": "", "refresh": []})
    with pytest.raises(ValueError, match="variant"):
        check_run("ablation", {"recipe": "tiny", "variants": ["nocolon"], "seeds": 2, "overrides": [], "refresh": []})


def _state(client, run_id) -> tuple[str, str]:
    state = client.read_flow_run(run_id).state
    return state.name, state.message or ""


@pytest.mark.slow
def test_a_deployment_run_with_a_bad_override_fails_at_once_instead_of_waiting_for_its_slot(api_url):
    """Through the API: `smollm3/full` (concurrency 1) with one run holding the slot; a run with
    `training.optimizer.lrr=0.001` waits in AwaitingConcurrencySlot until the check fails it
    with the recipe's message; a good run behind it keeps waiting."""
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment
    from prefect.states import Cancelled, Pending

    from flows.deployments import deployments

    full = next(d for d in deployments() if d.flow_name == "smollm3")
    full.apply()
    name = "smollm3/full"
    holder = run_deployment(name, parameters={"overrides": ["stages=[]"]}, timeout=0, as_subflow=False)
    bad = run_deployment(name, parameters={"overrides": ["training.optimizer.lrr=0.001"]}, timeout=0, as_subflow=False)
    good = run_deployment(name, parameters={"overrides": ["stages=[]"]}, timeout=0, as_subflow=False)
    with get_client(sync_client=True) as client:
        for run in (holder, bad, good):  # what the serve process's runner proposes for each
            client.set_flow_run_state(run.id, Pending())
        assert _state(client, holder.id)[0] == "Pending"  # holds the slot
        assert _state(client, bad.id)[0] == "AwaitingConcurrencySlot"
        refused = ScheduledRunCheck([("smollm3", "full")]).refuse_invalid_runs(client)
        assert [r for r, _ in refused] == [str(bad.id)]
        state, message = _state(client, bad.id)
        assert state == "Failed" and "training.optimizer.lrr: unknown field" in message, message
        assert message.startswith("Refused before it started")
        assert _state(client, good.id)[0] == "AwaitingConcurrencySlot"  # a good run keeps waiting

    # The serve process's watcher: a new bad run fails within seconds of being scheduled.
    stop = threading.Event()
    watch_scheduled_runs([("smollm3", "full")], every_s=0.5, stop=stop)
    try:
        late = run_deployment(name, parameters={"recipe": "tny"}, timeout=0, as_subflow=False)
        deadline = time.monotonic() + 60
        with get_client(sync_client=True) as client:
            while _state(client, late.id)[0] != "Failed" and time.monotonic() < deadline:
                time.sleep(0.2)
            state, message = _state(client, late.id)
            for run in (holder, good):  # leave the deployment's slot free for other tests
                client.set_flow_run_state(run.id, Cancelled())  # orchestrated: releases the slot
    finally:
        stop.set()
    assert state == "Failed" and "no recipe 'tny'" in message, (state, message)


@pytest.mark.slow
def test_smollm3_run_without_a_server_starts_one_for_the_run_and_stops_it(tmp_path, workspace_copy):
    """No PREFECT_API_URL and no demo: the data part of the tiny DAG runs against a server
    started for it, however long that server takes to come up on this machine. The workspace is a
    copy of the session's finished one (tests/conftest.py): the server's lifetime is under test
    here, not the steps' builds, so every step of the run reuses its finished folder."""
    from tests.conftest import DATA_ONLY

    ws = workspace_copy("data")

    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(
        SMOLLM3_HOME=str(tmp_path), PREFECT_HOME=str(tmp_path / "prefect"), PYTHONPATH=str(REPO)
    )  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "flows.cli", "run", "tiny", *DATA_ONLY, f"workspace={ws}"],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "starting a Prefect server for this run" in done.stderr and "Prefect server up after" in done.stderr
    assert "'states': {" in done.stdout and "'failed'" not in done.stdout
    port = done.stderr.split("for this run on 127.0.0.1:")[1].split()[0]
    left = [
        p.info for p in psutil.process_iter(["pid", "cmdline"]) if f"--port {port}" in " ".join(p.info["cmdline"] or [])
    ]
    assert not left, left  # the server went with the command
