"""`make demo` and `make down`: an embedded Prefect server, the serve process, one full run.

`up` starts `prefect server start` (SQLite under the workspace, analytics off) and the serve process
(`python -m flows.deployments`) unless they are already running, waits for the `smollm3/full`
deployment, runs `prefect deployment run smollm3/full --watch`, and prints where to look. Both
background processes are left running so the UI stays up; their pids and start times are kept in
`.demo/` so that `down` stops exactly the processes `up` started and nothing else.
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

from flows.report import summary
from infra.lineage import Lineage
from infra.proc import run_streaming

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
                cmd, cwd=ROOT, env={**os.environ, **env}, stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
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
    req = urllib.request.Request(
        f"{env['PREFECT_API_URL']}/deployments/name/{name}", method="GET"
    )
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
    from infra.workspace import resolve_workspace

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
        server.start([str(bin_dir / "prefect"), "server", "start", "--host", "127.0.0.1",
                      "--port", str(port)], env)
    _wait("Prefect server", lambda: _healthy(port), 120, server.log)
    if serve.alive():
        print("[demo] serve process already running")
    else:
        print("[demo] starting the serve process (python -m flows.deployments)")
        serve.start([sys.executable, "-m", "flows.deployments"], env)
    _wait(f"deployment {deployment}", lambda: _deployment_ready(env, deployment), 120, serve.log)
    print(f"[demo] prefect deployment run {deployment} --watch")
    code = 0
    try:
        run_streaming(
            [str(bin_dir / "prefect"), "deployment", "run", deployment, "--watch"],
            log=print, cwd=ROOT, env=env,
        )
    except Exception as exc:  # the run failed: still show what happened, then fail
        print(f"[demo] the run did not complete: {exc}")
        code = 1
    print()
    print(summary(Lineage(workspace / "lineage.duckdb"), ui_url=f"http://127.0.0.1:{port}"))
    print(f"\nServer and serve process keep running for the UI; `make down` stops them. "
          f"Logs: {server.log}, {serve.log}")
    return code


def down(state: Path) -> int:
    stopped = [m.name for m in (Managed(state, "serve"), Managed(state, "server")) if m.stop()]
    print(f"[down] stopped: {', '.join(stopped)}" if stopped else "[down] nothing to stop")
    return 0
