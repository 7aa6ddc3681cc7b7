"""`make demo` and `make down`: an embedded Prefect server, the serve process, one full run.

`up` starts `prefect server start` (SQLite under the workspace, analytics off) and the serve process
(`python -m flows.deployments`) unless they are already running, waits for the `smollm3/full`
deployment, starts a run of it and `watch`es it (flows/watch.py, what `smollm3 watch` prints):
one line per step state change (running, completed, cached, retrying, failed) and each running
step's latest training line (step/total, loss, tokens/s, ETA) or evaluation progress, at most
every 10 s, read from the Prefect API (task runs and progress artifacts of the flow run) instead
of Prefect's raw event stream. Then it prints the run's summary and where to look. Both background processes are left running so the UI
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
from flows.watch import watch
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


def _wait(what: str, check, timeout: float, process: Managed) -> None:
    """Until `check()` holds, by the wall clock; a process that exited meanwhile fails at once."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        if not process.alive():
            break
        time.sleep(0.5)
    log = process.log
    tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
    why = "exited" if not process.alive() else f"did not come up within {timeout:.0f}s"
    raise SystemExit(f"{what} {why}; last lines of {log}:\n{tail}")


def up(workspace: Path, port: int, state: Path, deployment: str = "smollm3/full", recipe: str = "tiny") -> int:
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
    _wait("Prefect server", lambda: _healthy(port), 600, server)
    if serve.alive():
        print("[demo] serve process already running")
    else:
        print("[demo] starting the serve process (python -m flows.deployments)")
        serve.start([sys.executable, "-m", "flows.deployments"], env)
    _wait(f"deployment {deployment}", lambda: _deployment_ready(env, deployment), 600, serve)
    os.environ.update(env)  # this process's Prefect client talks to the demo's server
    from prefect.deployments import run_deployment

    # The run writes where this command shows it: `--workspace` reaches the recipe as an override
    # (without it a `make demo WORKSPACE=/elsewhere` run would train in the recipe's own workspace
    # and the summary below would find no run).
    flow_run = run_deployment(
        deployment,
        parameters={"recipe": recipe, "overrides": [f"workspace={workspace}"]},
        timeout=0,
        as_subflow=False,
    )
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


def down(state: Path) -> int:
    stopped = [m.name for m in (Managed(state, "serve"), Managed(state, "server")) if m.stop()]
    print(f"[down] stopped: {', '.join(stopped)}" if stopped else "[down] nothing to stop")
    return 0
