"""`make demo` and `make down`: an embedded Prefect server, the serve process, one full run.

`up` starts `prefect server start` (SQLite under the workspace, analytics off) and the serve process
(`python -m flows.deployments`) unless they are already running, waits for the `smollm3/full`
deployment, starts a run of it and `watch`es it: one line per step state change (running,
completed, cached, retrying, failed) and the running steps' progress, read from the Prefect API
(task runs and progress artifacts of the flow run) instead of Prefect's raw event stream. Then it
prints the run's summary and where to look. Both background processes are left running so the UI
stays up; their pids and start times are kept in `.demo/` so that `down` stops exactly the
processes `up` started and nothing else.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from flows.views import summary
from pipeline.lineage import Lineage

ROOT = Path(__file__).resolve().parent.parent


def prefect_env(workspace: Path, port: int) -> dict[str, str]:
    """Settings shared by the server, the serve process and the CLI clients of the demo."""
    home = workspace / "prefect"
    home.mkdir(parents=True, exist_ok=True)
    return {
        "PREFECT_HOME": str(home),
        "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
        "PREFECT_SERVER_API_HOST": "127.0.0.1",
        "PREFECT_SERVER_API_PORT": str(port),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{home / 'prefect.db'}",
        "PREFECT_LOGGING_TO_API_BATCH_INTERVAL": "0.5",
        # flow runs heartbeat; the serve process installs the automation that crashes silent ones
        "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "60",
    }


def _start_time(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


class Managed:
    """A background process recorded in `.demo/NAME.json` (pid plus kernel start time)."""

    def __init__(self, state: Path, name: str):
        self.file = state / f"{name}.json"
        self.log = state / f"{name}.log"
        self.name = name

    def alive(self) -> bool:
        if not self.file.exists():
            return False
        info = json.loads(self.file.read_text())
        return _start_time(info["pid"]) == info["start"]

    def start(self, cmd: list[str], env: dict[str, str]) -> None:
        self.file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as log:
            proc = subprocess.Popen(
                cmd,
                cwd=ROOT,
                env={**os.environ, **env},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.file.write_text(json.dumps({"pid": proc.pid, "start": _start_time(proc.pid), "cmd": cmd}))

    def stop(self) -> bool:
        if not self.alive():
            self.file.unlink(missing_ok=True)
            return False
        pid = json.loads(self.file.read_text())["pid"]
        os.killpg(pid, signal.SIGTERM)
        for _ in range(100):
            if _start_time(pid) is None:
                break
            time.sleep(0.1)
        else:
            os.killpg(pid, signal.SIGKILL)
        self.file.unlink(missing_ok=True)
        return True


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, TimeoutError):
        return False


def _deployment_ready(env: dict[str, str], name: str) -> bool:
    req = urllib.request.Request(f"{env['PREFECT_API_URL']}/deployments/name/{name}", method="GET")
    try:
        with urllib.request.urlopen(req, timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, TimeoutError):
        return False


def _wait(what: str, check, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.5)
    tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
    raise SystemExit(f"{what} did not come up within {timeout:.0f}s; last lines of {log}:\n{tail}")


def up(workspace: Path, port: int, state: Path, deployment: str = "smollm3/full") -> int:
    from pipeline.workspace import resolve_workspace

    workspace = resolve_workspace(workspace)  # the folder the served runs resolve it to
    env = prefect_env(workspace, port)
    bin_dir = Path(sys.executable).parent
    server, serve = Managed(state, "server"), Managed(state, "serve")
    if server.alive():
        print(f"[demo] Prefect server already running (pid file {server.file})")
    elif _healthy(port):
        raise SystemExit(
            f"port {port} already serves a Prefect API that this demo did not start; stop it or "
            f"run `make demo PREFECT_PORT=<free port>`"
        )
    else:
        print(f"[demo] starting Prefect server on 127.0.0.1:{port} (SQLite in {env['PREFECT_HOME']})")
        server.start([str(bin_dir / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)], env)
    _wait("Prefect server", lambda: _healthy(port), 120, server.log)
    if serve.alive():
        print("[demo] serve process already running")
    else:
        print("[demo] starting the serve process (python -m flows.deployments)")
        serve.start([sys.executable, "-m", "flows.deployments"], env)
    _wait(f"deployment {deployment}", lambda: _deployment_ready(env, deployment), 120, serve.log)
    os.environ.update(env)  # this process's Prefect client talks to the demo's server
    from prefect.deployments import run_deployment

    flow_run = run_deployment(deployment, timeout=0, as_subflow=False)
    print(f"[demo] started {deployment} run {flow_run.id}; UI: http://127.0.0.1:{port}/runs/flow-run/{flow_run.id}")
    print(f"[demo] training curves, live: {tracker_hint(workspace)}")
    final, message = watch(flow_run.id, lineage=Lineage(workspace / "lineage.duckdb"))
    code = 0
    if final != "Completed":  # still show what happened, then fail
        print(f"[demo] the run ended {final}: {message}")
        code = 1
    print()
    print(summary(Lineage(workspace / "lineage.duckdb"), ui_url=f"http://127.0.0.1:{port}"))
    print(f"\nTraining curves (every stage of every run): {tracker_hint(workspace)}")
    print(f"Server and serve process keep running for the UI; `make down` stops them. Logs: {server.log}, {serve.log}")
    return code


def tracker_hint(workspace: Path) -> str:
    """How to open the stages' TensorBoard runs (trainers/tracker.py writes them as they train)."""
    return f"{Path(sys.executable).parent / 'tensorboard'} --logdir {workspace / 'tensorboard'} (http://localhost:6006)"


# --- following a flow run ------------------------------------------------------------------------


def _clock() -> str:
    return time.strftime("%H:%M:%S")


def _seconds(run) -> str:
    if run.start_time and run.end_time:
        return f"{(run.end_time - run.start_time).total_seconds():.1f}s"
    return ""


class RunWatch:
    """What changed in a flow run since the last look: its state, each task run's state (one line
    per change) and each running step's progress (in steps of `every` percent)."""

    def __init__(self, flow_run_id, every: float = 10.0, lineage: Lineage | None = None):
        self.flow_run_id = flow_run_id
        self.lineage = lineage  # where the runner recorded why an attempt failed (Prefect's
        # AwaitingRetry state carries no message)
        self.every = every
        self.states: dict = {}  # task run id -> last state name shown
        self.progress: dict[str, float] = {}  # step key -> last percentage shown
        self.flow_state: str | None = None
        self.width = 24

    def poll(self, client) -> tuple[list[str], object]:
        """(new lines, the flow run) after one look at the API."""
        from prefect.client.schemas.filters import (
            ArtifactFilter,
            ArtifactFilterFlowRunId,
            ArtifactFilterType,
            FlowRunFilter,
            FlowRunFilterId,
        )
        from prefect.client.schemas.sorting import TaskRunSort

        lines: list[str] = []
        flow_run = client.read_flow_run(self.flow_run_id)
        tasks, offset = [], 0
        while True:  # the API returns at most 200 rows at a time
            page = client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[self.flow_run_id])),
                sort=TaskRunSort.EXPECTED_START_TIME_ASC,
                limit=200,
                offset=offset,
            )
            tasks += page
            offset += len(page)
            if len(page) < 200:
                break
        if tasks:
            self.width = max(self.width, *(len(t.name) + 2 for t in tasks))
        for t in tasks:
            name = t.state.name if t.state else "Pending"
            if name in ("AwaitingRetry", "Retrying"):  # waiting for, then running, the next attempt
                name = "retrying"
            if self.states.get(t.id) == name or name in ("Scheduled", "Pending"):
                continue
            self.states[t.id] = name
            note = ""
            if name in ("Completed", "Cached"):
                retries = (t.run_count or 1) - 1  # a retry faster than a poll is still told
                note = _seconds(t) + (f" (after {retries} retr{'y' if retries == 1 else 'ies'})" if retries > 0 else "")
            elif name == "retrying":
                note = (t.state.message or self._retried_cause(t.name))[:160]
            elif t.state and (t.state.is_failed() or t.state.is_crashed()):
                note = (t.state.message or "")[:300]
            lines.append(f"{_clock()} {t.name:<{self.width}} {name:<10} {note}".rstrip())
        running = {t.name for t in tasks if t.state and t.state.is_running()}
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(
                flow_run_id=ArtifactFilterFlowRunId(any_=[self.flow_run_id]), type=ArtifactFilterType(any_=["progress"])
            )
        )
        for a in artifacts:  # the runner's progress artifacts: description = the step key
            key, percent = a.description or a.key or "", float(a.data or 0.0)
            last = self.progress.get(key, 0.0)
            if key in running and (percent >= last + self.every or (percent >= 100 > last)):
                self.progress[key] = percent
                lines.append(f"{_clock()} {key:<{self.width}} {percent:5.1f}%")
        name = flow_run.state.name if flow_run.state else "Pending"
        if name != self.flow_state:
            self.flow_state = name
            lines.append(
                f"{_clock()} flow run {name}"
                + (
                    f": {flow_run.state.message}"
                    if flow_run.state and flow_run.state.message and flow_run.state.is_final()
                    else ""
                )
            )
        return lines, flow_run

    def _retried_cause(self, key: str) -> str:
        """The cause the runner recorded for the newest failed attempt of step `key`."""
        if self.lineage is None:
            return ""
        rows = [
            r
            for r in self.lineage.steps_of(str(self.flow_run_id))
            if f"{r['step']}[{r['label']}]" == key and r["state"] == "retried"
        ]
        return rows[-1]["error"] or "" if rows else ""


def watch(flow_run_id, poll: float = 2.0, out=print, lineage: Lineage | None = None) -> tuple[str, str]:
    """Print what changes in a flow run until it ends; returns (final state name, its message)."""
    from prefect.client.orchestration import get_client

    w = RunWatch(flow_run_id, lineage=lineage)
    with get_client(sync_client=True) as client:
        while True:
            lines, flow_run = w.poll(client)
            for line in lines:
                out(f"[demo] {line}")
            if flow_run.state is not None and flow_run.state.is_final():
                return flow_run.state.name, flow_run.state.message or ""
            time.sleep(poll)


def down(state: Path) -> int:
    stopped = [m.name for m in (Managed(state, "serve"), Managed(state, "server")) if m.stop()]
    print(f"[down] stopped: {', '.join(stopped)}" if stopped else "[down] nothing to stop")
    return 0
