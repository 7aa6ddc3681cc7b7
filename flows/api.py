"""Which Prefect API a `smollm3 run` reports to, chosen before the flow starts.

1. `PREFECT_API_URL` (or the Prefect profile's), when set: it must answer now, or the command
   says so at once instead of timing out in the middle of the run;
2. else the demo's server (`make demo`, pid file `.demo/server.json`) when it runs, so the run
   shows in the UI at <http://127.0.0.1:4200>;
3. else a Prefect server started for this run and stopped after it (infra/prefect_server.py
   `EmbeddedServer`: waited for by the wall clock, a server that exits reported at once), not
   Prefect's ephemeral one, whose start-up timeout fails on a busy machine.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from infra.prefect_server import EmbeddedServer, healthy

ROOT = Path(__file__).resolve().parent.parent


def demo_api(state: Path = ROOT / ".demo") -> str | None:
    """The API of the demo's server when it runs (its pid file names the process and its port)."""
    from flows.demo import Managed

    server = Managed(state, "server")
    if not server.alive():
        return None
    cmd = json.loads(server.file.read_text()).get("cmd", [])
    port = cmd[cmd.index("--port") + 1] if "--port" in cmd else "4200"
    url = f"http://127.0.0.1:{port}/api"
    return url if healthy(url) else None


def drain_events(timeout: float = 30.0) -> None:
    """Deliver what this process's Prefect events worker still holds and stop it (a new one
    starts at the next event). Prefect keeps one events worker per process for any server and
    binds it to the API URL current when it started: left running after its server stops, it
    retries every later event against the dead address (10 reconnections each) and
    `drain_all` at exit then waits for that backlog (seen: 473 events, hours). Call it while
    the server it sends to is still up, and whenever this process switches API URL. Bounded
    by `timeout` seconds: what is still unsent then is left to the stopped worker."""
    from prefect.events.worker import EventsWorker

    EventsWorker.drain_all(timeout=timeout)


@contextmanager
def embedded_api(home: str | None = None, log=print) -> Iterator[str]:
    """A Prefect server of this block's own (`EmbeddedServer`) as this process's API; the
    process's events reach it before it stops, and none are left bound to its address."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with EmbeddedServer(home=home, log=log) as server:
        drain_events()  # a worker bound to another API would send this block's events there
        try:
            with temporary_settings(updates={PREFECT_API_URL: server.api_url}):
                yield server.api_url
        finally:
            drain_events()


@contextmanager
def running_api() -> Iterator[str]:
    """A Prefect API that runs already (`PREFECT_API_URL`, else the demo's server), for
    commands that read runs rather than start them (`smollm3 watch`)."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    url = PREFECT_API_URL.value() or demo_api()
    if not url:
        raise LookupError(
            "no Prefect server to read runs from: set PREFECT_API_URL (e.g. "
            "http://127.0.0.1:4200/api) or start one with `make demo`"
        )
    if not healthy(url, timeout=30.0):
        raise LookupError(f"the Prefect API at {url} does not answer (GET /health failed)")
    with temporary_settings(updates={PREFECT_API_URL: url}):
        yield url


@contextmanager
def prefect_api(log=print) -> Iterator[str]:
    """The API this process's Prefect client uses inside the block (see the module docstring)."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    configured = PREFECT_API_URL.value()
    if configured:
        if not healthy(configured, timeout=30.0):
            raise ValueError(
                f"PREFECT_API_URL={configured} does not answer (GET /health failed); start that server, "
                "or unset PREFECT_API_URL to run with a server of this run's own"
            )
        yield configured
        return
    url = demo_api()
    if url is not None:
        log(f"reporting to the demo's Prefect server {url} (UI: {url.removesuffix('/api')})")
        with temporary_settings(updates={PREFECT_API_URL: url}):
            yield url
        return
    with embedded_api(log=log) as url:
        yield url
