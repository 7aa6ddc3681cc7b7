"""The serve process that owns a flow run: a run that loses it ends `Crashed`, saying so.

`python -m flows.deployments` (the serve process) starts every flow run in a child process
(Prefect's runner), reads that child's console output through a pipe and is the only process that
can cancel it. When the serve process dies alone (SIGKILL, the OOM killer) the flow process lives
on without an owner: nothing can cancel it any more, and its console is a pipe nobody reads. The
first line logged there used to end the run from inside the logging call (rich turns a broken pipe
into `SystemExit` in whichever thread was logging): "Execution was aborted by Python system exit
call", half-way through a step, a trained stage left without its marker.

So the serve process names itself in `SMOLLM3_RUN_OWNER` (pid and kernel start time; inherited
by the flow-run processes it starts), and every run (pipeline/runner.py `RunContext`):
- keeps logging when its console's reader is gone: a broken pipe mutes the console (stdout and
  stderr go to /dev/null) instead of raising, in Prefect's console handler and in every write to
  `sys.stdout`/`sys.stderr` (`QuietStream`: lm-eval's progress bars, prints); Prefect's API keeps
  every log line. Logging to a dead parent never fails a step;
- attributes a step that fails while its owner dies to that death, whatever the timing: a step
  that fails checks its owner there and then (`owner_died_before`; a broken pipe waits up to two
  seconds for the death to show) instead of trusting that the watchdog looked first, so it is
  recorded `stopped: the serve process ... died`, never as a failure of its own;
- watches its owner (`infra.guard.watch`: pid and start time, about twice a second) and, when it
  dies, stops: running children (torchrun and its ranks, child-process steps) are killed, no further
  step starts, steps that finished keep their outputs and markers, and the run ends `Crashed` with
  a message naming the dead serve process and `prefect flow-run retry <run id>`, which resumes it
  from its finished steps and checkpoints once a serve process runs again.

A run whose flow-run process itself died (SIGKILL with its serve process, the OOM killer) is marked
Crashed within seconds by its sentinel (pipeline/sentinel.py). For what the sentinel cannot see
(a lost node takes it along) the serve process installs the server-side automation Prefect
documents for "zombie" flow runs (`ensure_crash_detection`): without it such a run stays `Running`
in Prefect forever and holds its deployment's concurrency slot. Every flow run emits a
`prefect.flow-run.heartbeat` event every `PREFECT_FLOWS_HEARTBEAT_FREQUENCY` seconds
(infra/prefect_server.py `heartbeat_seconds`); the automation is a proactive trigger that marks a
run `Crashed` when neither a heartbeat nor a final state follows a heartbeat within `missed`
heartbeat periods, so it can be retried.
"""

from __future__ import annotations

import errno
import logging
import os
import sys
import time
from collections.abc import Callable, MutableMapping
from typing import Any

from infra.guard import ProcessRef, watch
from infra.prefect_server import CRASH_AUTOMATION, heartbeat_seconds

OWNER_ENV = "SMOLLM3_RUN_OWNER"


def name_owner(env: MutableMapping[str, str] = os.environ) -> str:
    """Make this process (the serve process) the owner of the flow runs it starts."""
    env[OWNER_ENV] = ProcessRef.current().encode()
    return env[OWNER_ENV]


def run_owner(env: MutableMapping[str, str] = os.environ) -> ProcessRef | None:
    """The serve process that started this flow-run process, or None (a run started by the CLI,
    a test or a worker; or a process further down that inherited the variable)."""
    raw = env.get(OWNER_ENV, "")
    pid, _, start = raw.partition(":")
    if not pid.isdigit() or not start.isdigit():
        return None
    owner = ProcessRef(int(pid), int(start), *_here())
    # Its direct child, or an orphan already (the owner died before this run began watching)
    if os.getppid() == owner.pid or owner.alive() is False:
        return owner
    return None


def _here() -> tuple[str, str]:
    me = ProcessRef.current()
    return me.host, me.boot


def mute_console() -> None:
    """Send this process's stdout and stderr to /dev/null: their reader is gone."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        for fd in (1, 2):
            os.dup2(devnull, fd)
    finally:
        os.close(devnull)


def survive_broken_console() -> None:
    """A console whose reader died goes quiet instead of raising SystemExit in the logging thread.

    Prefect's console handler prints through rich, whose `Console.on_broken_pipe` (documented as
    the method to override) mutes the console and raises `SystemExit(1)`, so the first log line
    after the serve process died ended the run from inside a step. Idempotent."""
    for logger in (
        logging.getLogger(),
        *(
            lg
            for name, lg in logging.Logger.manager.loggerDict.items()
            if isinstance(lg, logging.Logger) and name.startswith("prefect")
        ),
    ):
        for handler in logger.handlers:
            console = getattr(handler, "console", None)
            if console is not None and hasattr(console, "on_broken_pipe"):
                console.on_broken_pipe = _quiet(console)


def _quiet(console) -> Callable[[], None]:
    def on_broken_pipe() -> None:
        console.quiet = True
        mute_console()

    return on_broken_pipe


class QuietStream:
    """A console stream (sys.stdout, sys.stderr) that a dead reader cannot fail: a write or flush
    that meets a broken pipe mutes the console (`mute_console`) and goes to /dev/null instead of
    raising into whatever step was printing (lm-eval's progress bars, a `print`). Everything else
    is the wrapped stream's."""

    def __init__(self, stream):
        self._stream = stream

    def _guarded(self, call, *args):
        try:
            return call(*args)
        except BrokenPipeError:
            mute_console()  # fds 1 and 2 now /dev/null: the retry cannot fail the same way
            try:
                return call(*args)
            except OSError:
                return None
        except ValueError:  # written after the stream was closed at shutdown
            return None

    def write(self, text: str) -> int:
        written = self._guarded(self._stream.write, text)
        return len(text) if written is None else written

    def writelines(self, lines) -> None:
        self._guarded(self._stream.writelines, lines)

    def flush(self) -> None:
        self._guarded(self._stream.flush)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def quiet_console_streams() -> None:
    """Make `sys.stdout` and `sys.stderr` `QuietStream`s (idempotent): logging or printing to a
    parent that died never fails a step."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, QuietStream):
            setattr(sys, name, QuietStream(stream))


def broken_pipe(exc: BaseException | None) -> bool:
    """Whether a failure is (or was raised from) a write into a pipe whose reader is gone."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, BrokenPipeError) or (isinstance(exc, OSError) and exc.errno == errno.EPIPE):
            return True
        if type(exc) is RuntimeError and str(exc).startswith("BrokenPipeError"):  # a child's failure
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def owner_dead(owner: ProcessRef) -> bool:
    """The serve process has died: its pid and start time no longer match, or this process was
    reparented away from it (what a child sees first)."""
    return owner.alive() is False or os.getppid() != owner.pid


def owner_died_before(owner: ProcessRef, exc: BaseException, grace: float = 2.0) -> bool:
    """Whether a step's failure came with (or of) its owner's death, asked at the moment the step
    failed, without waiting for the watchdog's next look. A broken pipe is what a dead reader
    causes: its process may still be exiting, so that failure waits up to `grace` seconds for
    the death to show; any other failure is asked once."""
    deadline = time.monotonic() + (grace if broken_pipe(exc) else 0.0)
    while not owner_dead(owner):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


def watch_owner(owner: ProcessRef, on_death: Callable[[ProcessRef], object]) -> None:
    """Call `on_death(owner)` once, from a daemon thread, when the serve process has died."""
    watch(owner, lambda: on_death(owner), name="run-owner-watchdog")


# --- runs whose flow-run process died: the server-side crash automation ----------------------


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
