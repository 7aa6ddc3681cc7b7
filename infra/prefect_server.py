"""Environment for a Prefect server and its clients, safe by default beyond one machine.

On a laptop the Prefect server listens on 127.0.0.1 with SQLite and needs no password. On a
cluster it listens where workers on other nodes can reach it, and then anyone on that network could
read logs, cancel runs or start deployments: Prefect's API has no authentication unless
`PREFECT_SERVER_API_AUTH_STRING` is set (HTTP basic auth, `user:password`), which its clients send
from `PREFECT_API_AUTH_STRING`. `server_env` therefore refuses a non-loopback host without an
auth string, and builds the rest of the settings that a server at scale needs (PostgreSQL instead
of SQLite, which serialises writers and does not survive many workers; analytics off).

The auth string and database password are secrets: they travel only in the returned environment
(for the child process), never in configs, lineage or logs; `redacted` masks them for printing.

Runs whose process died: a flow-run process killed without a chance to report (SIGKILL, OOM
killer, a lost node) stays `Running` in Prefect forever. Every flow run emits a
`prefect.flow-run.heartbeat` event every `PREFECT_FLOWS_HEARTBEAT_FREQUENCY` seconds (Prefect
3.1.8+; at least 30), and pipeline/owner.py installs the server-side automation Prefect
documents for this ("detect zombie flows"); `heartbeat_seconds` here is the period both use. It is
the fallback for a lost machine: a run's sentinel (pipeline/sentinel.py) reports a dead flow-run
process within seconds.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Mapping

AUTH_SERVER = "PREFECT_SERVER_API_AUTH_STRING"
AUTH_CLIENT = "PREFECT_API_AUTH_STRING"
DATABASE_URL = "PREFECT_SERVER_DATABASE_CONNECTION_URL"
_SECRET_KEYS = {AUTH_SERVER, AUTH_CLIENT}


class InsecureServerError(ValueError):
    """A server setting that would expose an unauthenticated API; the message says what to do."""


def is_loopback(host: str) -> bool:
    """True for hosts only this machine can reach (127.0.0.0/8, ::1, localhost)."""
    if host.strip().lower() in {"localhost", "localhost.localdomain", "ip6-localhost"}:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a hostname or a wildcard: reachable from elsewhere


def check_auth(auth: str) -> str:
    user, sep, password = auth.partition(":")
    if not sep or not user or not password:
        raise InsecureServerError(
            "the Prefect auth string must look like user:password (both non-empty); generate one "
            "with e.g. `echo admin:$(openssl rand -hex 16)` and keep it in a secret store"
        )
    return auth


def server_env(
    host: str = "127.0.0.1",
    port: int = 4200,
    auth: str | None = None,
    *,
    database_url: str | None = None,
    home: str | None = None,
) -> dict[str, str]:
    """Settings for `prefect server start` (and for clients on the same machine).

    host: where the API listens; anything but loopback (0.0.0.0, a NIC address, a hostname)
      requires `auth`. database_url: e.g. `postgresql+asyncpg://prefect@db:5432/prefect`; None
      keeps Prefect's default (SQLite under PREFECT_HOME). home: PREFECT_HOME for the server.
    """
    if not 0 < int(port) < 65536:
        raise ValueError(f"Prefect server port {port} is not a TCP port (1-65535)")
    if auth is not None:
        check_auth(auth)
    elif not is_loopback(host):
        raise InsecureServerError(
            f"Prefect server host {host!r} is reachable beyond this machine, but no auth string "
            f"was given: anyone on the network could run or cancel flows. Pass auth='user:password' "
            f"(sets {AUTH_SERVER} for the server and {AUTH_CLIENT} for clients), or listen on "
            "127.0.0.1 and reach it through an SSH tunnel"
        )
    client_host = "127.0.0.1" if host in {"0.0.0.0", "::", ""} else host
    if ":" in client_host and not client_host.startswith("["):
        client_host = f"[{client_host}]"
    env = {
        "PREFECT_SERVER_API_HOST": host,
        "PREFECT_SERVER_API_PORT": str(port),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        **client_env(f"http://{client_host}:{port}/api", auth),
    }
    if auth is not None:
        env[AUTH_SERVER] = auth
    if database_url is not None:
        if not database_url.startswith(("postgresql+asyncpg://", "sqlite+aiosqlite://")):
            raise ValueError(
                f"Prefect database URL {redact_url(database_url)!r} must use the "
                "postgresql+asyncpg:// (or sqlite+aiosqlite://) driver"
            )
        env[DATABASE_URL] = database_url
    if home is not None:
        env["PREFECT_HOME"] = home
    return env


def client_env(api_url: str, auth: str | None = None) -> dict[str, str]:
    """Settings for a client (a worker, `prefect deployment run`, a flow process) of a server."""
    env = {"PREFECT_API_URL": api_url}
    if auth is not None:
        env[AUTH_CLIENT] = check_auth(auth)
    return env


def redact_url(url: str) -> str:
    """A database URL with its password replaced by ***."""
    return re.sub(r"(//[^:/@]+:)[^@]*@", r"\1***@", url)


def redacted(env: Mapping[str, str]) -> dict[str, str]:
    """`env` safe to print or log: auth strings and database passwords masked."""
    out = {}
    for key, value in env.items():
        if key in _SECRET_KEYS:
            out[key] = "***"
        elif key == DATABASE_URL:
            out[key] = redact_url(value)
        else:
            out[key] = value
    return out


# --- crash detection for runs whose process died -----------------------------------------------

HEARTBEAT_ENV = "PREFECT_FLOWS_HEARTBEAT_FREQUENCY"
# Prefect's own default. The automation is server-wide, so its window must cover the slowest
# heartbeat of any flow run on that server: a worker elsewhere left at Prefect's default would
# otherwise see its healthy runs marked Crashed. Set the variable to the same value everywhere
# to detect faster (the demo, whose server serves only its own runs, uses 60).
DEFAULT_HEARTBEAT_S = 180
CRASH_AUTOMATION = "smollm3: mark runs that stopped heartbeating as Crashed"


def heartbeat_seconds(env: Mapping[str, str] | None = None) -> int:
    """The heartbeat period flow runs use: the environment's setting, else DEFAULT_HEARTBEAT_S."""
    raw = (os.environ if env is None else env).get(HEARTBEAT_ENV)
    if raw is None:
        return DEFAULT_HEARTBEAT_S
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{HEARTBEAT_ENV}={raw!r} is not a whole number of seconds") from None
    if value < 30:
        raise ValueError(f"{HEARTBEAT_ENV}={value}: Prefect requires at least 30 seconds")
    return value


# --- a server for one `smollm3 run` ------------------------------------------------------------


class ServerStartError(RuntimeError):
    """The Prefect server did not come up; the message has its last output."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the kernel's choice)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def healthy(api_url: str, timeout: float = 2.0) -> bool:
    """Whether the Prefect API at `api_url` answers its health check."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"{api_url.rstrip('/')}/health", timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, TimeoutError, ValueError):
        return False


class EmbeddedServer:
    """`prefect server start` on a free loopback port for the life of one command, waited for
    by the wall clock until it answers or exits.

    Prefect's own ephemeral server (what a flow called without PREFECT_API_URL starts) counts its
    start-up timeout in loop iterations of 0.1 s, so a loaded machine waits several times the 20 s
    it names, and a server that exited is noticed only at the end: "Timed out while attempting
    to connect to ephemeral Prefect API server" after a minute. Here a server that exits is
    reported at once with its output, a port taken between choosing and binding it is retried
    on another, and the deadline (`timeout` seconds, default 600) is real time. The server runs
    under infra/guard.py's guard, so it ends with this process however that ends."""

    def __init__(self, home: str | None = None, timeout: float = 600.0, log=print):
        self.home, self.timeout, self.log = home, timeout, log
        self.proc = None
        self.api_url = ""
        self._output = None

    def __enter__(self) -> EmbeddedServer:
        import subprocess
        import sys
        import tempfile
        import time
        from pathlib import Path

        prefect = str(Path(sys.executable).parent / "prefect")
        started = time.monotonic()
        for _ in range(3):  # a port taken by someone else between choosing and binding it
            port = free_port()
            self.api_url = f"http://127.0.0.1:{port}/api"
            self._output = tempfile.TemporaryFile()
            env = {**os.environ, **server_env("127.0.0.1", port), "PREFECT_SERVER_UI_ENABLED": "false"}
            if self.home:
                env["PREFECT_HOME"] = self.home
            self.log(f"starting a Prefect server for this run on 127.0.0.1:{port} (stopped when it ends)")
            from infra.guard import ProcessRef, guard_command

            # Under the guard: the server dies with this process, even when it is SIGKILLed.
            cmd = [prefect, "server", "start", "--host", "127.0.0.1", "--port", str(port), "--no-ui"]
            self.proc = subprocess.Popen(
                guard_command(ProcessRef.current(), cmd),
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=self._output,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            while time.monotonic() - started < self.timeout:
                if healthy(self.api_url, timeout=5.0):
                    self.log(f"Prefect server up after {time.monotonic() - started:.0f}s: {self.api_url}")
                    return self
                if self.proc.poll() is not None:
                    break
                time.sleep(0.25)
            else:
                tail = self._tail()
                self.stop()
                raise ServerStartError(
                    f"the Prefect server did not answer within {self.timeout:.0f}s; its last output:\n{tail}"
                )
            tail = self._tail()
            if "address already in use" not in tail.lower():
                raise ServerStartError(f"the Prefect server exited with code {self.proc.returncode}:\n{tail}")
        raise ServerStartError(f"no free port for the Prefect server after 3 tries:\n{self._tail()}")

    def _tail(self, chars: int = 3000) -> str:
        if self._output is None:
            return ""
        self._output.seek(0)
        return self._output.read().decode(errors="replace")[-chars:]

    def stop(self) -> None:
        import signal
        import subprocess

        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(30)
            except (ProcessLookupError, OSError):
                pass
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def __exit__(self, *exc) -> None:
        self.stop()
