"""pipeline/live.py: a step's progress artifact, updated from whichever thread reports it."""

from __future__ import annotations

import functools
import threading
import time

import pytest

# Both tests on one worker, on one server of the module's own (`live_api_url`).
pytestmark = pytest.mark.xdist_group("live-server")


@pytest.fixture(scope="module")
def live_api_url(tmp_path_factory):
    """One Prefect server for this module's tests, of their own as `smollm3 run`'s is
    (flows/api.py `embedded_api`, set through Prefect's settings context): on the session's
    harness, Prefect's temporary server is the harness itself. The tests read back what only
    they wrote (an artifact key, an event name of their own)."""
    from flows.api import embedded_api

    home = tmp_path_factory.mktemp("live-prefect-home")
    with embedded_api(home=str(home), log=lambda _: None) as url:
        yield url


def _from_a_thread_of_a_task(make_call) -> None:
    """Run a flow whose one task builds `call = make_call()` in its own thread (where the Prefect
    context is) and then calls it from a new thread, as a step's watcher or supervisor does."""
    from prefect import flow, task

    @task
    def work() -> None:
        thread = threading.Thread(target=make_call())
        thread.start()
        thread.join(timeout=120)
        assert not thread.is_alive()

    @flow
    def run() -> None:
        work()

    run()


def test_progress_reported_from_a_thread_of_the_step_reaches_the_runs_server(live_api_url):
    """Progress comes from threads the step starts (the stage's metrics watcher, the timer that
    sends a throttled line): a new thread has no Prefect settings context, so its update went to a
    temporary server Prefect started for it instead of the run's API (a `smollm3 run` of
    tiny-learn started two, one still running after the run ended) and the UI never showed it.
    On a server of the test's own, as `smollm3 run` has (flows/api.py `embedded_api`): on the
    session's harness, Prefect's temporary server is the harness itself."""
    from prefect.artifacts import Artifact

    from pipeline.live import LiveStatus

    _from_a_thread_of_a_task(
        lambda: functools.partial(LiveStatus("step[x]", "live-thread-test-progress", every_s=0.0).progress, 42.0)
    )
    assert Artifact.get("live-thread-test-progress").data == 42.0


def test_a_stage_event_sent_from_the_supervisors_thread_reaches_the_runs_server(live_api_url):
    """A stage's flags become Prefect events sent from the thread that supervises the trainer
    (tasks/pretrain.py `_run_context`): with no Prefect context there, the events worker started a
    temporary server and the events never reached the run's API."""
    import httpx

    from tasks.pretrain import _run_context

    resource = {"prefect.resource.id": "smollm3.stage.test", "prefect.resource.name": "stage1"}
    _from_a_thread_of_a_task(
        lambda: functools.partial(_run_context()[1], "smollm3.training.test_flag", {"resource": resource, "step": 3})
    )
    from flows.api import drain_events

    drain_events()
    deadline, found = time.monotonic() + 60, []
    while not found and time.monotonic() < deadline:  # the server stores events in the background
        reply = httpx.post(
            f"{live_api_url}/events/filter",
            json={"filter": {"event": {"name": ["smollm3.training.test_flag"]}}, "limit": 5},
            timeout=10,
        )
        reply.raise_for_status()
        found = reply.json()["events"]
        time.sleep(0.5)
    assert [e["payload"]["step"] for e in found] == [3], found
