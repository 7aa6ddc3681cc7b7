"""Follow a flow run in the terminal: `smollm3 watch [RUN]` and the demo's live view.

One look at the Prefect API every `poll` seconds (task runs and the runner's progress artifacts
of the flow run, pipeline/live.py), printed as lines:

    14:02:11 pretrain[stage2]        Running
    14:02:21 pretrain[stage2]         40.0% stage2 step 12/30 | loss 4.1520 | ... | 9,870 tok/s | ETA 1m12s
    14:02:24 evaluate[stage1]         61.0% lm-eval: 610/1,000 items (61%) | prose_cloze 100/100 ... | ETA 20s
    14:02:40 evaluate[stage1]        Completed  31.2s
    14:03:05 flow run Completed

- a line per state change of each task run (running, completed with its time, cached, retrying
  with the cause, failed with the cause), and of the flow run (a retried run shows
  AwaitingRetry, then Running again, then its steps);
- for each running step its latest progress line (training: step/total, loss, tokens/s, ETA;
  evaluation: items done per task, ETA), printed when it changed, at most every `every_s`
  seconds per step (default 10), so what the terminal shows is never more than that plus one
  poll behind; a step that reports a percentage only prints its percentage in 10% steps.

`smollm3 watch` follows any run of the server (a deployment run, a CLI run, a `prefect
flow-run retry`), by id, id prefix or `latest`, until it ends; it exits 0 when the run
Completed, else 1. Started on a run already under way, it sums up the steps so far in one line
and follows from there.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from pipeline.lineage import Lineage
from pipeline.live import parse


def _clock() -> str:
    return time.strftime("%H:%M:%S")


def _seconds(run) -> str:
    if run.start_time and run.end_time:
        return f"{(run.end_time - run.start_time).total_seconds():.1f}s"
    return ""


class RunWatch:
    """What changed in a flow run since the last look (see the module docstring)."""

    def __init__(
        self,
        flow_run_id,
        every_s: float = 10.0,
        lineage: Lineage | None = None,
        backlog: bool = True,
        clock=time.monotonic,
        percent_step: float = 10.0,
    ):
        self.flow_run_id = flow_run_id
        self.lineage = lineage  # where the runner recorded why an attempt failed (Prefect's
        # AwaitingRetry state carries no message)
        self.every_s, self.percent_step, self.clock = every_s, percent_step, clock
        self.backlog = backlog  # print the task runs found at the first look (else sum them up)
        self.states: dict = {}  # task run id -> last state name shown
        self.status: dict = {}  # task run id -> (monotonic time, percent, line) last shown
        self.flow_state: str | None = None
        self.width = 24
        self.looks = 0

    def _task_runs(self, client) -> list:
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
        from prefect.client.schemas.sorting import TaskRunSort

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
                return tasks

    def _live(self, client) -> dict:
        """task run id -> (percent, latest progress line) of its newest progress artifact."""
        from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterType
        from prefect.client.schemas.sorting import ArtifactSort

        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(
                flow_run_id=ArtifactFilterFlowRunId(any_=[self.flow_run_id]), type=ArtifactFilterType(any_=["progress"])
            ),
            sort=ArtifactSort.CREATED_DESC,
            limit=200,
        )
        live: dict = {}
        for a in artifacts:  # newest first: a retried attempt's artifact wins over the earlier one
            if a.task_run_id is not None and a.task_run_id not in live:
                live[a.task_run_id] = (float(a.data or 0.0), parse(a.description)[1])
        return live

    def poll(self, client) -> tuple[list[str], Any]:
        """(new lines, the flow run) after one look at the API."""
        lines: list[str] = []
        flow_run = client.read_flow_run(self.flow_run_id)
        tasks = self._task_runs(client)
        if tasks:
            self.width = max(self.width, *(len(t.name) + 2 for t in tasks))
        first = self.looks == 0
        self.looks += 1
        if first and not self.backlog and tasks:
            counts = Counter(t.state.name if t.state else "Pending" for t in tasks)
            lines.append(
                f"{_clock()} so far: {len(tasks)} task runs ("
                + ", ".join(f"{n} {s}" for s, n in counts.most_common())
                + ")"
            )
            for t in tasks:  # shown as a sum; only running steps get their own line
                if not (t.state and t.state.is_running()):
                    self.states[t.id] = t.state.name if t.state else "Pending"
        lines += self._state_lines(tasks)
        lines += self._status_lines(client, tasks)
        name = flow_run.state.name if flow_run.state else "Pending"
        if name != self.flow_state:
            self.flow_state = name
            final = flow_run.state and flow_run.state.is_final()
            message = f": {flow_run.state.message}" if final and flow_run.state.message else ""
            lines.append(f"{_clock()} flow run {name}{message}")
        return lines, flow_run

    def _state_lines(self, tasks: list) -> list[str]:
        lines = []
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
        return lines

    def _status_lines(self, client, tasks: list) -> list[str]:
        """Each running step's latest progress line, when it changed, at most every `every_s`."""
        running = {t.id: t.name for t in tasks if t.state and t.state.is_running()}
        if not running:
            return []
        lines, now = [], self.clock()
        for task_id, (percent, line) in self._live(client).items():
            if task_id not in running:
                continue
            shown = self.status.get(task_id)
            if line:
                due = shown is None or now - shown[0] >= self.every_s or percent >= 100 > shown[1]
                if not due or (shown is not None and (shown[1], shown[2]) == (percent, line)):
                    continue
            elif shown is not None and percent < shown[1] + self.percent_step and not percent >= 100 > shown[1]:
                continue  # a percentage alone: in steps of `percent_step`
            elif shown is None and percent <= 0:
                continue
            self.status[task_id] = (now, percent, line)
            lines.append(f"{_clock()} {running[task_id]:<{self.width}} {percent:5.1f}% {line}".rstrip())
        return lines

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


def watch(
    flow_run_id,
    poll: float = 2.0,
    out=print,
    lineage: Lineage | None = None,
    every_s: float = 10.0,
    backlog: bool = True,
    prefix: str = "[demo] ",
) -> tuple[str, str]:
    """Print what changes in a flow run until it ends; returns (final state name, its message)."""
    from prefect.client.orchestration import get_client

    w = RunWatch(flow_run_id, every_s=every_s, lineage=lineage, backlog=backlog)
    with get_client(sync_client=True) as client:
        while True:
            lines, flow_run = w.poll(client)
            for line in lines:
                out(f"{prefix}{line}")
            if flow_run.state is not None and flow_run.state.is_final():
                return flow_run.state.name, flow_run.state.message or ""
            time.sleep(poll)


def find_flow_run(client, ref: str = "latest") -> Any:
    """A flow run of the server by id, id prefix or `latest` (the newest run not yet finished,
    else the newest)."""
    from prefect.client.schemas.sorting import FlowRunSort

    runs = client.read_flow_runs(sort=FlowRunSort.EXPECTED_START_TIME_DESC, limit=200)
    if ref == "latest":
        unfinished = [r for r in runs if r.state is None or not r.state.is_final()]
        if unfinished or runs:
            return (unfinished or runs)[0]
        raise LookupError("no flow runs on this Prefect server")
    found = [r for r in runs if str(r.id).startswith(ref.lower())]
    if not found:
        raise LookupError(f"no flow run {ref!r} among the newest 200 on this server; `prefect flow-run ls` lists them")
    if len(found) > 1:
        raise LookupError(f"flow run prefix {ref!r} is ambiguous: {', '.join(str(r.id)[:8] for r in found)}")
    return found[0]
