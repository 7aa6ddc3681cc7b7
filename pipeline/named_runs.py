"""Task runs that carry their step's name from the moment they exist, not from when they start.

Prefect's thread-pool task runner creates a submitted task run as `evaluate-a8e` (the task's
name and a random suffix) and applies `task_run_name` only once the run starts, after its
upstream futures resolved. A graph submits every step at once, so for most of a run the UI and
the demo terminal showed `evaluate-a8e`, `merge-be8`, `grpo-42d`: which stage's evaluation waits
could not be told.

`NamedTaskRunner` is that runner with one difference: a task whose `task_run_name` is a plain
string (pipeline/runner.py names every step `step[label]`) gets its task run built, named and
announced (the Pending event the engine would send) at submission, and the engine runs that task
run instead of creating its own. The task run, its inputs (the graph's edges) and its state are
exactly the engine's; only the name is final from the first event. Any other task (a templated
or callable name, an async task) takes Prefect's own path.

It relies on two names inside Prefect (`prefect.task_engine._create_task_run_locally`, which
the engine itself calls to build the run, and the runner's executor bookkeeping), pinned by
`prefect>=3.9,<4`; tests/pipeline/test_named_runs.py checks through the API that pending runs
carry their names, so an upgrade that moves them fails there, not silently.
"""

from __future__ import annotations

import threading
from contextvars import copy_context
from typing import Any

from prefect.futures import PrefectConcurrentFuture
from prefect.task_runners import ThreadPoolTaskRunner


def fixed_name(task: Any) -> str | None:
    """The run name of `task` when it is a plain string (no template, no callable)."""
    name = getattr(task, "task_run_name", None)
    return name if isinstance(name, str) and "{" not in name else None


class NamedTaskRunner(ThreadPoolTaskRunner):
    """Prefect's `ThreadPoolTaskRunner` whose task runs exist under their final name from the
    start (see the module docstring)."""

    def submit(self, task, parameters, wait_for=None, dependencies=None):
        name = fixed_name(task)
        if name is None or task.isasync:
            return super().submit(task, parameters, wait_for, dependencies)
        if not self._started or self._executor is None:
            raise RuntimeError("Task runner is not started")
        from prefect.task_engine import _create_task_run_locally, run_task_sync
        from prefect.utilities.engine import emit_task_run_state_change_event

        task_run = _create_task_run_locally(
            task=task, parameters=parameters, wait_for=wait_for, extra_task_inputs=dependencies
        )
        task_run.name = name
        # The Pending event the engine sends for a run it creates itself: the API row is made
        # from it, so the row has the step's name from the start.
        emit_task_run_state_change_event(task_run=task_run, initial_state=None, validated_state=task_run.state)
        cancel_event = threading.Event()
        self._cancel_events[task_run.id] = cancel_event
        future = self._executor.submit(
            copy_context().run,
            run_task_sync,
            task=task,
            task_run_id=task_run.id,
            task_run=task_run,
            parameters=parameters,
            wait_for=wait_for,
            return_type="state",
            dependencies=dependencies,
            context=dict(cancel_event=cancel_event),
        )
        with self._submission_lock:
            self._active_submission_count += 1
        future.add_done_callback(self._on_executor_future_done)
        return PrefectConcurrentFuture(task_run_id=task_run.id, wrapped_future=future)
