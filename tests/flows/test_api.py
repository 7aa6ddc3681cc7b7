"""The Prefect API a command of this process reports to (flows/api.py)."""

from __future__ import annotations

import psutil
import pytest


@pytest.mark.slow
def test_a_server_of_the_blocks_own_gets_its_events_and_no_worker_outlives_it(tmp_path):
    """Prefect keeps one events worker per process, bound to the API URL current when it
    started. The worker that sent this block's event is drained before the server stops: none is
    left retrying the dead address (which held a whole CI run at its last test until its limit)."""
    from prefect.events import emit_event
    from prefect.events.worker import EventsWorker
    from prefect.settings import PREFECT_API_URL

    from flows.api import embedded_api

    with embedded_api(home=str(tmp_path), log=lambda _: None) as url:
        assert PREFECT_API_URL.value() == url
        assert emit_event("smollm3.test.sent", resource={"prefect.resource.id": "smollm3.test"}) is not None
        worker = EventsWorker.instance()
        server = [
            p
            for p in psutil.process_iter(["cmdline"])
            if url.split(":")[-1].split("/")[0] in " ".join(p.info["cmdline"] or [])
        ]
    assert PREFECT_API_URL.value() != url
    assert worker._stopped and worker._queue.empty(), "an events worker outlived its server"
    assert worker not in EventsWorker._instances.values()
    assert server and not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in server)
