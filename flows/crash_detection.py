"""Runs whose process died are marked Crashed: the server-side automation Prefect documents for
"zombie" flow runs, installed by the serve process (flows/deployments.py).

A flow-run process killed without a chance to report (SIGKILL, OOM killer, a lost node) stays
`Running` in Prefect forever and holds its deployment's concurrency slot. Every flow run emits a
`prefect.flow-run.heartbeat` event every `PREFECT_FLOWS_HEARTBEAT_FREQUENCY` seconds
(infra/prefect_server.py `heartbeat_seconds`); the automation is a proactive trigger that marks a
run `Crashed` when neither a heartbeat nor a final state follows a heartbeat within `missed`
heartbeat periods, so it can be retried.
"""

from __future__ import annotations

from typing import Any

from infra.prefect_server import CRASH_AUTOMATION, heartbeat_seconds


def crash_detection_automation(heartbeat_s: int, missed: int = 3) -> Any:
    """The automation (not yet created): after a run's heartbeat, expect another heartbeat or a
    final state within `missed` heartbeat periods, else set the run Crashed."""
    from datetime import timedelta

    from prefect.automations import Automation
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification

    within = heartbeat_s * missed
    return Automation(
        name=CRASH_AUTOMATION,
        description=f"A flow run that emitted no heartbeat for {within}s (heartbeats every "
        f"{heartbeat_s}s) has lost its process: mark it Crashed so it can be retried.",
        trigger=EventTrigger(
            after={"prefect.flow-run.heartbeat"},
            expect={
                "prefect.flow-run.heartbeat",
                "prefect.flow-run.Completed",
                "prefect.flow-run.Failed",
                "prefect.flow-run.Cancelled",
                "prefect.flow-run.Crashed",
                # a paused run stops heartbeating on purpose
                "prefect.flow-run.Paused",
                "prefect.flow-run.Suspended",
            },
            match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=timedelta(seconds=within),
        ),
        actions=[
            ChangeFlowRunState(
                state=StateType.CRASHED,
                message=f"no heartbeat for {within}s: the flow-run process died (killed, out of "
                "memory, or its machine was lost); retry the run to resume from its "
                "completed steps and checkpoints",
            )
        ],
    )


def ensure_crash_detection(heartbeat_s: int | None = None, missed: int = 3) -> Any:
    """Create (or update to this period) the crash-detection automation on the current API."""
    from prefect.automations import Automation

    wanted = crash_detection_automation(heartbeat_s or heartbeat_seconds(), missed)
    try:
        existing = Automation.read(name=CRASH_AUTOMATION)
    except ValueError:  # not there yet
        return wanted.create()
    same = (
        existing.trigger.model_dump(exclude={"id"}) == wanted.trigger.model_dump(exclude={"id"})
        and existing.actions == wanted.actions
    )
    if same:
        return existing
    wanted.id = existing.id
    wanted.update()
    return wanted
