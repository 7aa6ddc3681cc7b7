"""pipeline/live.py: a step's progress artifact, updated from whichever thread reports it."""

from __future__ import annotations

import threading


def test_progress_reported_from_a_thread_of_the_step_reaches_the_runs_server(private_api_url):
    """Progress comes from threads the step starts (the stage's metrics watcher, the timer that
    sends a throttled line): a new thread has no Prefect settings context, so its update went to a
    temporary server Prefect started for it instead of the run's API (a `smollm3 run` of
    tiny-learn started two, one still running after the run ended) and the UI never showed it.
    On a server of the test's own, as `smollm3 run` has (flows/api.py `embedded_api`): on the
    session's harness, Prefect's temporary server is the harness itself."""
    from prefect import flow, task
    from prefect.artifacts import Artifact

    from pipeline.live import LiveStatus

    @task
    def work() -> None:
        live = LiveStatus("step[x]", "live-thread-test-progress", every_s=0.0)
        thread = threading.Thread(target=live.progress, args=(42.0,))
        thread.start()
        thread.join(timeout=120)
        assert not thread.is_alive()

    @flow
    def run() -> None:
        work()

    run()
    assert Artifact.get("live-thread-test-progress").data == 42.0
