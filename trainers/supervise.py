"""The pretrain step's eye on a running launch: flags as they happen, and hangs the ranks cannot end.

Runs in the process that launched the trainer (the flow's pretrain step, tasks/pretrain.py), as a
thread beside the launcher, and reads only files of the stage folder (trainers/monitor.py and
trainers/watchdog.py write them), so it works the same for a local torchrun or a cluster job on a
shared file system:
- `monitor/events.jsonl`: each new flag (straggler, throughput drop, skipped step, non-finite
  value, data skipped) goes to `on_event` as it is written;
- `monitor/hang/*.json`: a rank's watchdog found no completed step within its bound. The
  supervisor reports it (`on_event`, kind `hung`), asks every rank on this host for its Python
  stacks (SIGUSR2; a stopped rank is continued first so it can answer, it is ended right after),
  and, when the launch has not ended `grace_s` later (torchrun itself frozen or lost), ends it
  (`end_launch`: the local launcher's process tree);
- `monitor/heartbeat/*.json`: a rank frozen whole (SIGSTOP, a node gone, a C call holding the GIL)
  writes no report. When a rank's last completed step is older than its bound plus `grace_s`
  (less the time the rank's own process did not run, `stalled_s`), or its heartbeat is silent
  past max(`floor_s`, 4 heartbeats) plus `grace_s`, the supervisor writes the hang report on its
  behalf and proceeds as above.

A loaded machine is no hang: a rank is reported only when it is seen silent (or idle) on
`confirm` polls in a row, each poll on time; a poll that comes more than `STALL_S` late (this
process did not run either: the machine, not the rank, stood still) starts the count again. A rank
whose training ended (its last heartbeat's phase is `ended`) is never silent: the seconds its
process takes to exit are torchrun's to wait for (a clean run at load 9-12 once reported its
ranks hung during that teardown).

`reset_launch_files` clears the hang reports and heartbeats before each launch, so what the
supervisor and the launcher's failure facts read describes the launch that runs.

`StageEvents` is where the pretrain step sends each flag: a lineage row (`train_events`), a task-log
line for what the ranks did not log themselves, and, inside a flow run, a Prefect event through the
function the step passes (Prefect stays out of this package). `roll_back` is the step's answer to
a non-finite value: plan the data window to skip (trainers/monitor.py) and relaunch.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from infra.files import write_atomic
from infra.guard import start_time
from infra.launchers.base import HANG_DIR, LaunchFailed, describe_hang, hang_reports
from infra.proc import kill_tree
from infra.storage import PULLED
from model.spec import TrainSpec, WatchdogConfig
from pipeline.workspace import Workspace
from trainers.watchdog import ENDED, HEARTBEAT_DIR, STACK_SIGNAL, STALL_S, frozen_ranks

# trainers/monitor.py (what the ranks run) imports torch: the light commands that import the steps
# (`smollm3 recipe`, `plan`) must not, so its names are imported where they are used.

EventFn = Callable[[dict[str, Any]], None]


def reset_launch_files(out_dir: Path) -> None:
    """Before a launch: no hang report, heartbeat or finished pull (trainers/pretrain.py
    `pull_mirror`: its ranks wait for this launch's) of an earlier launch survives."""
    for sub in (HANG_DIR, HEARTBEAT_DIR):
        shutil.rmtree(Path(out_dir) / sub, ignore_errors=True)
    (Path(out_dir) / PULLED).unlink(missing_ok=True)


def heartbeats(out_dir: Path) -> list[dict[str, Any]]:
    beats = []
    for path in sorted((Path(out_dir) / HEARTBEAT_DIR).glob("rank*.json")):
        try:
            beat = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # being replaced: the next poll reads it
        if isinstance(beat, dict):
            beats.append(beat)
    return beats


def _stopped(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
    except (OSError, IndexError):
        return False


class StageSupervisor(threading.Thread):
    """See the module docstring. `start()` before the launch, `close()` after it."""

    def __init__(
        self,
        out_dir: Path,
        config: WatchdogConfig,
        on_event: EventFn,
        end_launch: Callable[[], None] | None = None,
        poll_s: float = 0.5,
    ) -> None:
        super().__init__(name=f"stage-supervisor-{Path(out_dir).name}", daemon=True)
        self.out, self.config, self.on_event, self.end_launch = Path(out_dir), config, on_event, end_launch
        self.poll_s = poll_s
        self._done = threading.Event()
        from trainers.monitor import EVENTS_FILE

        events = self.out / EVENTS_FILE
        self._offset = events.stat().st_size if events.exists() else 0  # earlier launches' flags are known
        self.hang: dict[str, Any] | None = None  # the first hang report of this launch
        self.hang_known_at: float | None = None
        self.ended = False  # whether this supervisor ended the launch
        self.host = socket.gethostname()
        self._seen: dict[Any, int] = {}  # rank -> polls in a row it was seen silent or idle past its bound
        self._late = False  # the last wait ended more than STALL_S late

    def run(self) -> None:
        while True:
            asked = time.monotonic()
            if self._done.wait(self.poll_s):
                return
            self._late = self._late or time.monotonic() - asked - self.poll_s > STALL_S
            self.poll()

    def close(self) -> None:
        """Stop watching; what was written until now is still reported."""
        self._done.set()
        if self.is_alive():
            self.join(timeout=10)
        self.poll(final=True)

    def poll(self, final: bool = False) -> None:
        try:
            self._read_events()
            if self.config.enabled and not final:
                self._watch_hangs()
        except Exception as exc:  # noqa: BLE001 - watching must never break the launch it watches
            try:
                self.on_event(
                    {"kind": "supervisor_error", "message": f"stage supervisor: {exc!r}", "time": time.time()}
                )
            except Exception:  # noqa: BLE001 - the sink itself fails (a full disk): keep watching
                pass

    # -- flags --

    def _read_events(self) -> None:
        from trainers.monitor import EVENTS_FILE

        path = self.out / EVENTS_FILE
        try:
            with open(path, "rb") as fh:
                fh.seek(self._offset)
                chunk = fh.read()
        except OSError:
            return
        end = chunk.rfind(b"\n") + 1  # a line being written is read at the next poll
        self._offset += end
        for line in chunk[:end].splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                self.on_event(record)

    # -- hangs --

    def _watch_hangs(self) -> None:
        now = time.time()
        if self.hang is None:
            reports = hang_reports(self.out)
            if reports:
                self._hang_known(reports[0])
                return
            if self._late:  # this process did not run either: what it sees now says nothing of the ranks
                self._late = False
                self._seen.clear()
                return
            # A rank's heartbeat thread beats through long phases (a checkpoint's or start-up's
            # long bound) too: a heartbeat silent past the floor means the process itself is frozen.
            silent_bound = max(self.config.floor_s, 4 * self.config.heartbeat_s) + self.config.grace_s
            beats = [b for b in heartbeats(self.out) if b.get("phase") != ENDED]
            beats.sort(key=lambda b: -(now - float(b.get("time", now))))
            for beat in beats:  # the most silent first: a frozen rank, not one waiting on it
                idle = now - float(beat.get("last_progress", now)) - float(beat.get("stalled_s", 0.0))
                silent = now - float(beat.get("time", now))
                past = idle > float(beat.get("bound_s", float("inf"))) + self.config.grace_s or silent > silent_bound
                self._seen[beat.get("rank")] = self._seen.get(beat.get("rank"), 0) + 1 if past else 0
            for beat in beats:
                idle = now - float(beat.get("last_progress", now))
                if self._seen.get(beat.get("rank"), 0) >= self.config.confirm:
                    report = beat | {
                        "idle_s": idle,
                        "time": now,
                        "by": "pretrain step (the rank's own watchdog did not report)",
                        "why": f"heartbeat {now - float(beat.get('time', now)):.1f} s old",
                    }
                    write_atomic(
                        self.out / HANG_DIR / f"step-rank{beat.get('rank')}.json", json.dumps(report, indent=2)
                    )
                    self._hang_known(report)
                    return
        elif not self.ended and self.end_launch is not None and now - (self.hang_known_at or now) > self.config.grace_s:
            self.ended = True
            try:  # a sink that fails (a full disk, a lineage that refuses the row) must not keep it running
                self.on_event(
                    {
                        "kind": "hang_ended",
                        "stage": self.hang.get("stage"),
                        "step": self.hang.get("step"),
                        "message": f"the launch did not end {self.config.grace_s:g} s after the hang report: ending it",
                        "time": now,
                    }
                )
            finally:
                self.end_launch()

    def _hang_known(self, report: dict[str, Any]) -> None:
        if not report.get("frozen"):  # the reporting rank may be waiting on a rank that froze
            frozen = frozen_ranks(self.out, self.config.heartbeat_s, exclude=report.get("rank"))
            report = report | ({"frozen": frozen} if frozen else {})
        culprit = (report.get("frozen") or [report])[0]  # the frozen rank, else the one that reported
        self.hang, self.hang_known_at = report, time.time()
        try:
            self.on_event(
                {
                    "kind": "hung",
                    "stage": report.get("stage"),
                    "step": report.get("step"),
                    "rank": culprit.get("rank"),
                    "host": culprit.get("host"),
                    "value": report.get("idle_s"),
                    "threshold": report.get("bound_s"),
                    "message": f"hung: {describe_hang(report)}; reported by the {report.get('by', 'rank watchdog')}",
                    "time": report.get("time", time.time()),
                }
            )
        finally:  # the stacks are asked for even when the sink fails
            self._ask_stacks()

    def _ask_stacks(self) -> None:
        """SIGUSR2 to every rank of this launch on this host: each prints its Python stacks."""
        for beat in heartbeats(self.out):
            pid = beat.get("pid")
            if beat.get("host") != self.host or not isinstance(pid, int) or start_time(pid) != beat.get("start"):
                continue  # another host's, or the rank is gone (its pid may be another process's now)
            try:
                if _stopped(pid):
                    os.kill(pid, signal.SIGCONT)
                os.kill(pid, STACK_SIGNAL)
            except (ProcessLookupError, PermissionError):
                continue


# --- where flags go ------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunRef:
    """The flow run a stage trains in (all None outside one)."""

    run_id: str | None = None
    attempt: int | None = None  # the flow run's attempt (Prefect's run_count)
    task_try: int | None = None  # the pretrain task's try within it (its retries)


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


class StageEvents:
    """A stage's flags (see the module docstring). `emit(event_name, payload)` sends a Prefect
    event (its resource under the payload's "resource" key); None outside a flow run."""

    def __init__(self, out: Path, stage: str, log: Callable[[str], None], run: RunRef = RunRef(), emit=None) -> None:
        self.out, self.stage, self.log, self.run, self.emit = Path(out), stage, log, run, emit
        self.lineage = Workspace(root=str(self.out.parent.parent)).lineage()  # the step folder's workspace

    def __call__(self, event: dict[str, Any]) -> None:
        kind = str(event.get("kind"))
        if kind in ("hung", "hang_ended", "supervisor_error"):
            self.log(f"WARNING: {self.stage}: {event.get('message')}")  # the ranks' flags log themselves
        if kind == "throughput_reference":
            return  # a measurement, not a flag: it stays in the stage folder
        facts = {k: v for k, v in event.items() if k not in ("kind", "stage", "step", "message", "time")}
        when = datetime.fromtimestamp(float(event.get("time") or time.time()), UTC).replace(tzinfo=None)
        row = (
            str(self.out),
            self.stage,
            self.run.run_id,
            self.run.attempt,
            self.run.task_try,
            kind,
            event.get("step"),
            event.get("rank"),
            event.get("host"),
            _number(event.get("value")),
            _number(event.get("threshold")),
            event.get("message"),
            json.dumps(facts, default=str),
            when,
        )
        self.lineage.record_rows("train_events", [row])
        if self.emit is not None:
            resource = {
                "prefect.resource.id": f"smollm3.stage.{self.out.name}",
                "prefect.resource.name": self.stage,
                "smollm3.stage-dir": str(self.out),
            }
            payload = {"step": event.get("step"), "message": event.get("message"), **facts}
            self.emit(f"smollm3.training.{kind}", {"resource": resource, **payload})


def flag_counts(out: Path) -> dict[str, int]:
    """How many flags of each kind a stage raised (monitor/events.jsonl, all launches)."""
    counts: dict[str, int] = {}
    try:
        from trainers.monitor import EVENTS_FILE

        lines = (Path(out) / EVENTS_FILE).read_text().splitlines()
    except OSError:
        return counts
    for line in lines:
        try:
            kind = json.loads(line).get("kind", "?")
        except (ValueError, AttributeError):
            continue  # a line cut by a kill
        if kind != "throughput_reference":  # a measurement, not a flag
            counts[kind] = counts.get(kind, 0) + 1
    return counts


# --- what the step does about a hang or a non-finite value ---------------------------------------


def end_local(out: Path) -> None:
    """End a local launch whose ranks hung: the guard, torchrun and every rank (SIGKILL reaches
    stopped processes too); its process group is in `.trainer.pgid`."""
    try:
        pgid = int((Path(out) / ".trainer.pgid").read_text())
    except (OSError, ValueError):
        return
    kill_tree(pgid)


def non_finite(exc: BaseException) -> bool:
    """The launch ended because the trainer met a non-finite loss, gradient norm or weights."""
    facts = getattr(exc, "facts", None)
    return isinstance(exc, LaunchFailed) and facts is not None and facts.exitcode == 3


def roll_back(out: Path, spec: TrainSpec, sink: StageEvents, log: Callable[[str], None]) -> bool:
    """After a non-finite value: plan the data window to skip and say so (True: relaunch);
    False when the stage may skip no more (`nonfinite.retries`) or the trainer left no record."""
    from trainers.monitor import plan_skip, read_nonfinite, read_skips

    record = read_nonfinite(out)
    if record is None:
        return False
    window = plan_skip(out, record, spec.nonfinite)
    if window is None:
        log(
            f"WARNING: {spec.stage}: {record['what']} non-finite at step {record['step']} after "
            f"{spec.nonfinite.retries} data window(s) skipped already (training.nonfinite.retries): failing"
        )
        return False
    sequences = window["to"] - window["from"]
    since = (
        "from there"
        if window["from"] == record["checkpoint_sequence"]
        else f"of the last {spec.nonfinite.skip_steps} step(s)"
    )
    message = (
        f"non-finite {record['what']} at step {record['step']}: rolling back to the checkpoint of step "
        f"{record['checkpoint_step']} and skipping the {sequences} sequences ({sequences * record['seq_len']:,} "
        f"tokens) of data {since} through step {record['step']} (window {len(read_skips(out))} of at most "
        f"{spec.nonfinite.retries})"
    )
    log(f"WARNING: {spec.stage}: {message}")
    sink(
        {
            "kind": "rollback",
            "step": record["step"],
            "value": float(sequences * record["seq_len"]),
            "message": message,
            "window": window,
            "time": time.time(),
        }
    )
    return True
