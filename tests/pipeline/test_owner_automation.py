"""pipeline/owner.py: a flow run whose process is SIGKILLed is marked Crashed by the
automation `ensure_crash_detection` installs (real Prefect server, real flow process).

The environment builders (`server_env`, auth, PostgreSQL) are tested in test_prefect_scale.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from infra.prefect_server import CRASH_AUTOMATION, HEARTBEAT_ENV, heartbeat_seconds
from pipeline.owner import crash_detection_automation, ensure_crash_detection

REPO = Path(__file__).resolve().parents[2]


def test_heartbeat_period_comes_from_the_environment_and_respects_prefects_minimum():
    assert heartbeat_seconds({}) == 180  # Prefect's default: safe for runs started elsewhere
    assert heartbeat_seconds({HEARTBEAT_ENV: "45"}) == 45
    with pytest.raises(ValueError, match="at least 30 seconds"):
        heartbeat_seconds({HEARTBEAT_ENV: "10"})
    with pytest.raises(ValueError, match="not a whole number"):
        heartbeat_seconds({HEARTBEAT_ENV: "soon"})
    trigger = crash_detection_automation(60).trigger
    assert trigger.within.total_seconds() == 180 and trigger.posture == "Proactive"
    assert trigger.after == {"prefect.flow-run.heartbeat"}


FLOW = textwrap.dedent(
    """
    import time
    from prefect import flow

    @flow(name="sleeps-forever")
    def sleeps_forever():
        time.sleep(600)

    if __name__ == "__main__":
        sleeps_forever()
    """
)


@pytest.mark.slow
def test_a_sigkilled_flow_run_is_marked_crashed(prefect_harness, api_url, tmp_path):
    from prefect import get_client
    from prefect.automations import Automation
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName, FlowRunFilter

    # Idempotent: a second call (every serve start makes one) keeps one automation.
    ensure_crash_detection(heartbeat_s=30, missed=1)
    ensure_crash_detection(heartbeat_s=30, missed=1)
    with get_client(sync_client=True) as client:
        assert len(client.read_automations_by_name(CRASH_AUTOMATION)) == 1
    assert Automation.read(name=CRASH_AUTOMATION).trigger.within.total_seconds() == 30

    script = tmp_path / "flow.py"
    script.write_text(FLOW)
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=os.environ | {"PREFECT_API_URL": api_url, HEARTBEAT_ENV: "30"},
    )
    try:
        with get_client(sync_client=True) as client:
            flows = FlowFilter(name=FlowFilterName(any_=["sleeps-forever"]))
            run = None
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                runs = client.read_flow_runs(flow_filter=flows)
                if runs and runs[0].state.is_running():
                    run = runs[0]
                    break
                time.sleep(0.5)
            assert run is not None, "the flow never started running"
            time.sleep(3)  # its first heartbeat is sent as it starts running
            proc.kill()
            proc.wait()
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                state = client.read_flow_run(run.id).state
                if not state.is_running():
                    break
                time.sleep(2)
            assert state.is_crashed(), f"still {state.name} after its process was killed"
            assert "no heartbeat for 30s" in state.message
            assert client.read_flow_runs(flow_run_filter=FlowRunFilter(id={"any_": [run.id]}))[0].state.is_crashed()
    finally:
        proc.kill()
        Automation.read(name=CRASH_AUTOMATION).delete()
