"""A flow run's sentinel: when its flow-run process dies without closing the run, the run is marked
`Crashed` and its running steps `stopped` within seconds, so `prefect flow-run retry` works at once.

A flow-run process killed without a chance to report (the serve and flow processes SIGKILLed
together, `systemctl stop`, the OOM killer) used to stay `Running` in Prefect until the server's
heartbeat automation (pipeline/owner.py) noticed three missed heartbeats: 8.5 minutes at Prefect's
default 180 s heartbeat, during which `prefect flow-run retry` is refused ("not terminal"), and
lineage had no row at all for the step that was killed. Prefect's heartbeat cannot go below 30 s,
and a window of fewer than three periods would crash healthy runs on a loaded machine, whose
heartbeat thread can be late.

The project owns the flow-run process, so it need not guess from silence: every flow run opens a
sentinel (`python -m pipeline.sentinel`, standard library only until it has to act), a small
process in a session of its own, so that what kills the serve and flow process groups does not
kill it. It watches the flow-run process by pid *and* kernel start time (`infra.guard.ProcessRef`,
every `POLL_S` seconds, and at once when the pipe from the flow process reaches end of file), and
the runner tells it which steps run through a file it appends to (`open-steps-<attempt>.jsonl` in
the run's folder: a line when a step's task starts, when its build starts, when it is recorded).
When the run closes normally the runner writes `closed` on the sentinel's stdin and it exits (its
empty log, `sentinel-<attempt>.log` beside the file, is removed; one that acted keeps it).

When the process is gone without that word, the sentinel
1. records every step still open as `failed` with `stopped: the flow-run process (pid N) of this
   run died ...; recorded by its sentinel (pid M)` (a step still waiting for its slot: `skipped`,
   `not started: ...`) and the attempt as `crashed`, through the lineage journal like any other
   writer (pipeline/lineage/store.py: one journal per process, ingested under the lock);
2. sets the flow run `Crashed` through Prefect's API, saying which steps were stopped and how to
   resume, and the open steps' task runs `Crashed`, unless Prefect already holds a final state (a
   serve process that lived saw its child die and set `Crashed` itself; a cancellation).

It never guesses: a flow process that is alive, however slow (a machine at load 8, a process
stopped with SIGSTOP), is never marked, because only a pid whose start time no longer matches is
dead. It cannot see a lost machine (it dies with it): the heartbeat automation stays the fallback.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from uuid import UUID

from infra.guard import ProcessRef, boot_id

# How long the sentinel keeps setting the open steps' task runs `Crashed` until Prefect holds it
# (crash_in_prefect): the server records task runs from events, seconds late under load.
TASK_RUN_WAIT_S = 30.0

POLL_S = 1.0  # how often the sentinel looks at the flow-run process (its pipe's end is seen at once)
CLOSED = b"closed\n"
STEPS_FILE = "open-steps-{attempt}.jsonl"
REPO_ROOT = Path(__file__).resolve().parent.parent


# --- the flow-run process's side -------------------------------------------------------------


class Sentinel:
    """The runner's handle on its run's sentinel: which steps are open, and the normal close."""

    def __init__(self, proc: subprocess.Popen, steps: Path):
        self.proc, self.steps = proc, steps
        self._lock = threading.Lock()
        self._closed = False

    @classmethod
    def start(cls, run_id: str, attempt: int, run_dir: Path, lineage: Path, api_url: str | None) -> Sentinel:
        """Start the sentinel of this flow-run process for attempt `attempt` of run `run_id`."""
        steps = run_dir / STEPS_FILE.format(attempt=attempt)
        steps.write_text("")
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT__")}  # not a run of its own
        path = env.get("PYTHONPATH")
        env["PYTHONPATH"] = f"{REPO_ROOT}{os.pathsep}{path}" if path else str(REPO_ROOT)
        if api_url:
            env["PREFECT_API_URL"] = api_url
        me = ProcessRef.current()
        conf = {
            "flow_pid": me.pid,
            "flow_start": me.start,
            "run_id": run_id,
            "attempt": attempt,
            "steps": str(steps),
            "lineage": str(lineage),
            "api_url": api_url or "",
            "served": bool(os.environ.get("SMOLLM3_RUN_OWNER")),
        }
        log = open(run_dir / f"sentinel-{attempt}.log", "ab")  # noqa: SIM115 - the child's, closed below
        try:
            # Its own session: a signal to the serve or flow process group does not reach it. The
            # configuration goes on stdin, so no workspace path shows in its command line.
            proc = subprocess.Popen(
                [sys.executable, "-m", "pipeline.sentinel"],
                cwd=REPO_ROOT,
                env=env,
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            log.close()
        assert proc.stdin is not None
        proc.stdin.write(json.dumps(conf).encode() + b"\n")
        proc.stdin.flush()
        return cls(proc, steps)

    def _note(self, event: dict[str, Any]) -> None:
        with self._lock:
            if self._closed:
                return
            try:  # a line at a time, no fsync: a killed process keeps the page cache
                with open(self.steps, "a", encoding="utf-8") as fh:
                    fh.write(json.dumps(event, default=str) + "\n")
            except OSError:
                pass  # never fails a step: without the line, a crash records that step less precisely

    def entered(self, key: str, row: dict[str, Any], task_run: str | None) -> None:
        """A step's task started (it may still wait for its slot): `row` is its lineage row so far."""
        self._note({"event": "entered", "key": key, "row": row, "task_run": task_run})

    def building(self, key: str, started: datetime) -> None:
        """A step's build started (its slot granted)."""
        self._note({"event": "building", "key": key, "started": started.isoformat()})

    def ended(self, key: str) -> None:
        """A step's state was recorded in lineage: nothing left for the sentinel to say about it."""
        self._note({"event": "ended", "key": key})

    def close(self) -> None:
        """The run closes normally: the sentinel exits without a word."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(CLOSED)
            self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            pass  # a sentinel that is gone or slow to exit changes nothing for the run
        self.steps.unlink(missing_ok=True)
        log = self.steps.with_name(f"sentinel-{self.steps.stem.rsplit('-', 1)[-1]}.log")
        try:
            if log.stat().st_size == 0:  # a run that closed normally leaves nothing behind
                log.unlink()
        except OSError:
            pass


# --- the sentinel process ----------------------------------------------------------------------


def wait_for_death(flow: ProcessRef, stdin: int, poll: float = POLL_S) -> bool:
    """Block until the flow-run process closes the run (False) or dies without closing it (True)."""
    seen = b""
    eof = False
    while True:
        if not eof:
            ready, _, _ = select.select([stdin], [], [], poll)
            if ready:
                chunk = os.read(stdin, 4096)
                eof = not chunk
                seen = (seen + chunk)[-64:]
                if CLOSED in seen:
                    return False
        else:
            time.sleep(poll)
        if flow.alive() is False:
            return CLOSED not in seen


def open_steps(steps: Path) -> list[dict[str, Any]]:
    """The steps the file says were entered and not yet recorded, each with `started` when its
    build had begun."""
    entries: dict[str, dict[str, Any]] = {}
    try:
        lines = steps.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return []
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue  # the last line, cut by the kill
        key = event.get("key")
        if event.get("event") == "entered":
            entries[key] = {**event, "started": None}
        elif event.get("event") == "building" and key in entries:
            entries[key]["started"] = event["started"]
        elif event.get("event") == "ended":
            entries.pop(key, None)
    return list(entries.values())


def _now() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)


def record_stopped(conf: dict[str, Any], steps: list[dict[str, Any]], why: str, run_state: str) -> None:
    """The open steps' rows (`failed`, `stopped: ...`; `skipped` if not yet building) and the
    attempt's end, through the lineage journal."""
    from pipeline.lineage import Lineage, StepRow

    lineage = Lineage(Path(conf["lineage"]))
    now = _now()
    for entry in steps:
        row = entry["row"]
        building = entry["started"] is not None
        lineage.record_step(
            StepRow(
                row["run_id"],
                row["step"],
                row["label"],
                row["fingerprint"],
                "failed" if building else "skipped",
                row["config"],
                row["code_version"],
                datetime.fromisoformat(entry["started"]) if building else now,
                now,
                f"stopped: {why}" if building else f"not started: {why}",
                row["attempt"],
            )
        )
    lineage.end_run(conf["run_id"], run_state, attempt=conf["attempt"])


def _client():
    from prefect.client.orchestration import get_client

    return get_client(sync_client=True)


def prefect_state(conf: dict[str, Any]) -> str | None:
    """The flow run's state type in Prefect (`RUNNING`, ...), None when the API cannot be reached
    (a server that died with the flow process: `smollm3 run`'s own)."""
    from infra.prefect_server import healthy

    if not conf["api_url"] or not healthy(conf["api_url"], timeout=5.0):
        return None
    with _client() as client:
        state = client.read_flow_run(conf["run_id"]).state
    return state.type.value if state is not None else None


def crash_in_prefect(conf: dict[str, Any], steps: list[dict[str, Any]], message: str, why: str) -> None:
    """Set the flow run Crashed (not forced: a final state set meanwhile stays), and the open
    steps' task runs too, so the UI and `smollm3 watch` show no step still running."""
    from prefect.states import Crashed

    with _client() as client:
        client.set_flow_run_state(conf["run_id"], Crashed(message=message), force=False)
        # Prefect 3 records a task run from the events its flow process sent, through a server
        # service that lags on a loaded machine: a task run the flow entered just before the kill
        # may not exist yet (the state cannot be set), then appear `Running` seconds later. So
        # each is set, then read back until it holds a final state, for up to TASK_RUN_WAIT_S.
        open_runs = {UUID(entry["task_run"]): entry["key"] for entry in steps if entry.get("task_run")}
        deadline = time.monotonic() + TASK_RUN_WAIT_S
        while open_runs:
            for task_run, key in list(open_runs.items()):
                try:
                    state = client.read_task_run(task_run).state
                    if state is not None and state.is_final():
                        del open_runs[task_run]
                        continue
                    client.set_task_run_state(task_run, Crashed(message=f"stopped: {why}"), force=True)
                except Exception as exc:  # noqa: BLE001 - the flow run's state is what matters
                    if time.monotonic() >= deadline:
                        _say(f"could not mark task run {task_run} ({key}) Crashed: {exc}")
            if time.monotonic() >= deadline:
                break
            time.sleep(1.0)


def crash_message(conf: dict[str, Any], steps: list[dict[str, Any]], why: str) -> str:
    stopped = sorted(e["key"] for e in steps if e["started"] is not None)
    waiting = sorted(e["key"] for e in steps if e["started"] is None)
    where = " once a serve process runs again (`python -m flows.deployments`)" if conf.get("served") else ""
    return (
        f"{why}. Stopped while running: {', '.join(stopped) or 'none'}"
        f"{'; not started: ' + ', '.join(waiting) if waiting else ''}. Finished steps keep their "
        f"outputs. Resume with `prefect flow-run retry {conf['run_id']}`{where}."
    )


def act(conf: dict[str, Any], seen: datetime) -> str:
    """What the sentinel does once the flow-run process is gone without closing its run (`seen`:
    when it noticed, at most `POLL_S` after the death); returns what it did, for its log."""
    steps = open_steps(Path(conf["steps"]))
    why = (
        f"the flow-run process (pid {conf['flow_pid']}) of this run died without reporting (killed, "
        f"with its serve process or alone, or out of memory); seen at {seen:%H:%M:%S} UTC by the "
        f"run's sentinel (pid {os.getpid()})"
    )
    try:
        state = prefect_state(conf)
    except Exception as exc:  # noqa: BLE001 - lineage is recorded whatever the API says
        _say(f"could not read the flow run's state ({type(exc).__name__}: {exc}); recording lineage only")
        state = None
    if state in {"COMPLETED", "FAILED", "PAUSED", "SUSPENDED"}:
        return f"nothing to do: Prefect has the run {state}"
    cancelled = state in {"CANCELLING", "CANCELLED"}
    record_stopped(conf, steps, why, "cancelled" if cancelled else "crashed")
    if state == "RUNNING" or state == "PENDING":
        crash_in_prefect(conf, steps, crash_message(conf, steps, why), why)
        return f"marked Crashed: {crash_message(conf, steps, why)}"
    return f"recorded {len(steps)} open step(s) in lineage; Prefect has the run {state}"


def _say(message: str) -> None:
    try:
        print(f"[sentinel {time.strftime('%H:%M:%S')}] {message}", flush=True)
    except (OSError, ValueError):
        pass


def main() -> int:
    stdin = sys.stdin.buffer.fileno()
    first = b""
    while not first.endswith(b"\n"):  # the configuration line, read unbuffered: select sees the rest
        chunk = os.read(stdin, 1)
        if not chunk:
            return 0  # the flow process died before it finished starting us: nothing is open
        first += chunk
    conf = json.loads(first)
    flow = ProcessRef(conf["flow_pid"], conf["flow_start"], ProcessRef.current().host, boot_id())
    if not wait_for_death(flow, stdin):
        return 0
    seen = time.monotonic()
    _say(f"flow-run process {conf['flow_pid']} of run {conf['run_id']} is gone without closing its run")
    done = act(conf, datetime.now(UTC))
    _say(f"{done} ({time.monotonic() - seen:.1f}s after the death was seen)")
    Path(conf["steps"]).unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
