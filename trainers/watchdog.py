"""The hang watchdog of every training rank: no completed step within a bound ends the launch.

A hung collective (a dead NCCL peer, a rank stuck in a file system call) blocks every other rank
without an error for as long as the collective's own timeout, 10 to 30 minutes, or forever. Each
rank therefore runs a `Watchdog` thread that knows when the rank last completed a step and ends the
launch when that is longer ago than the bound:

    bound = max(floor_s, multiple x the running median step time)      while training
            startup_s                                                  before the first step
            checkpoint_s                                               while a checkpoint is saved,
                                                                       and after the last step
            startup_s since the last bytes arrived                     while a checkpoint is pulled
                                                                       (`advanced`, trainers/pretrain.py)

When it fires it writes the rank's hang report (`{out_dir}/monitor/hang/rank{N}.json`, read by the
launcher's failure facts, infra/launchers/base.py), prints every thread's Python stack to stderr
(the stage log), and ends the rank with exit code 5 (EXIT_HUNG): torchrun then stops the other
ranks, the launch fails as `hung` and the pretrain step's retry (or Slurm's requeue) resumes from
the last checkpoint. Collectives release the GIL, so the thread runs while the main thread waits.

What one rank cannot see, the pretrain step sees from outside (trainers/supervise.py): each rank's
watchdog writes a heartbeat (`{out_dir}/monitor/heartbeat/rank{N}.json`: pid, host, last completed
step and its time, the bound) every `heartbeat_s`; a rank frozen whole (SIGSTOP, a lost node)
stops writing it. And a C-level backstop (`faulthandler.dump_traceback_later`, armed at twice the
bound) dumps the stacks and exits even if the rank's Python thread cannot run (a C extension
holding the GIL). `SIGUSR2` prints a rank's stacks on demand (faulthandler's handler, also in C):
the step sends it to every rank it can reach when a hang is known.

A loaded machine is not a hang. The time a rank's own process did not run (the whole rank stopped
or starved: its watchdog thread woke more than `STALL_S` after it asked to) is left out of its
idle time, so a machine paused or slowed as a whole ends nothing, while a rank waiting on a frozen
peer (its thread wakes on time) still fires at its bound; the bound itself follows the launch's
own pace (the running median step). A rank that ends its training writes a last heartbeat,
`phase: "ended"`: the seconds from there to the process's exit (a slow teardown on a loaded
machine, torchrun waiting for its ranks) are no silence the pretrain step reports.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import socket
import statistics
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from infra.files import write_atomic
from infra.guard import start_time
from infra.launchers.base import HANG_DIR, NODE_ENV
from model.spec import WatchdogConfig

EXIT_HUNG = 5
HEARTBEAT_DIR = Path("monitor") / "heartbeat"
STACK_SIGNAL = signal.SIGUSR2  # print this rank's stacks (faulthandler)
ENDED = "ended"  # the phase of a rank's last heartbeat, written when its training ends
STALL_S = 1.0  # a watchdog thread waking this much later than it asked: its process did not run


def bound_for(config: WatchdogConfig, phase: str, step_times: list[float]) -> tuple[float, str]:
    """(seconds a rank may go without a completed step, how that was decided) in `phase`."""
    if phase == "pull":  # a checkpoint pull: the clock restarts whenever bytes arrive (`advanced`)
        return config.startup_s, "startup bound, counted from the pull's last progress"
    if phase == "startup" or not step_times:
        return config.startup_s, "startup bound"
    if phase in ("checkpoint", "ending"):  # a save, or the last save's wait and the stage's result
        return config.checkpoint_s, "checkpoint bound"
    median = statistics.median(step_times)
    scaled = config.multiple * median
    if scaled >= config.floor_s:
        return scaled, f"{config.multiple:g} x median step {median:.3g} s"
    return config.floor_s, f"floor {config.floor_s:g} s > {config.multiple:g} x median step {median:.3g} s"


def frozen_ranks(out_dir: Path, heartbeat_s: float, now: float | None = None, exclude: int | None = None) -> list[dict]:
    """The ranks whose heartbeat stopped: frozen whole (SIGSTOP, a lost node), not waiting. A rank
    blocked in a collective still beats (its watchdog thread runs while the collective holds
    no GIL), so when one rank freezes, the ranks waiting on it are told apart from it by this."""
    now = time.time() if now is None else now
    silent_after = max(4 * heartbeat_s, 1.0)  # a live beat may lag a few periods on a loaded host
    found = []
    for path in sorted((Path(out_dir) / HEARTBEAT_DIR).glob("rank*.json")):
        try:
            beat = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # being replaced: written a moment ago
        if not isinstance(beat, dict) or beat.get("rank") == exclude or beat.get("phase") == ENDED:
            continue  # an ended rank's heartbeat stops by design
        silent = now - float(beat.get("time", now))
        if silent > silent_after:
            found.append(
                {
                    "rank": beat.get("rank"),
                    "host": beat.get("host"),
                    "pid": beat.get("pid"),
                    "silent_s": round(silent, 1),
                }
            )
    return found


class Watchdog:
    """One rank's watchdog thread (see the module docstring). `completed()` after every step,
    `phase("checkpoint")` around a save; `stop()` at the end of training."""

    def __init__(self, config: WatchdogConfig, out_dir: Path, rank: int, stage: str, step: int = 0) -> None:
        self.config, self.rank, self.stage = config, rank, stage
        self.out_dir = Path(out_dir)
        self.hang_path = Path(out_dir) / HANG_DIR / f"rank{rank}.json"
        self.heartbeat_path = Path(out_dir) / HEARTBEAT_DIR / f"rank{rank}.json"
        self.host, self.pid, self.start_ticks = (
            os.environ.get(NODE_ENV) or socket.gethostname(),
            os.getpid(),
            start_time(os.getpid()),
        )
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._times: deque[float] = deque(maxlen=config.window)
        self._step = step  # last completed step
        self._phase = "startup"
        self._since = time.monotonic()  # when the last step completed (or the phase began)
        self._since_wall = time.time()
        self._stalled = 0.0  # seconds since `_since` this process did not run (left out of idle)
        self._thread: threading.Thread | None = None

    # -- what the training loop calls --

    def start(self) -> Watchdog:
        if not self.config.enabled:
            return self
        faulthandler.register(STACK_SIGNAL, file=sys.stderr, all_threads=True, chain=False)
        self._thread = threading.Thread(target=self._run, name=f"hang-watchdog-rank{self.rank}", daemon=True)
        self._thread.start()
        self._arm_backstop()
        return self

    def completed(self, step: int, seconds: float) -> None:
        """Step `step` completed, its training taking `seconds`."""
        with self._lock:
            self._step, self._phase = step, "train"
            self._times.append(seconds)
            self._since, self._since_wall, self._stalled = time.monotonic(), time.time(), 0.0
        self._arm_backstop()

    def begin_phase(self, name: str) -> None:
        """Work with a bound of its own (`checkpoint`) begins; `end_phase` when it is done."""
        with self._lock:
            self._phase = name
            self._since, self._since_wall, self._stalled = time.monotonic(), time.time(), 0.0
        self._arm_backstop()

    def advanced(self) -> None:
        """Work in the current phase made progress (a pull's bytes arrived): the clock restarts,
        so a long phase is bounded by its stalls, not by its length."""
        with self._lock:
            self._since, self._since_wall, self._stalled = time.monotonic(), time.time(), 0.0
        self._arm_backstop()

    def end_phase(self) -> None:
        """Back to training; the clock restarts."""
        with self._lock:
            self._phase = "train" if self._times else "startup"
            self._since, self._since_wall, self._stalled = time.monotonic(), time.time(), 0.0
        self._arm_backstop()

    def stop(self) -> None:
        """Training ended (however): the last heartbeat says so, then the thread stops."""
        self._stop.set()
        if self._thread is not None:
            faulthandler.cancel_dump_traceback_later()
            faulthandler.unregister(STACK_SIGNAL)
            self._thread.join(timeout=5)
            self._thread = None
            with self._lock:
                step = self._step
            self._heartbeat(step, ENDED, self.config.checkpoint_s)

    # -- the thread --

    def bound(self) -> tuple[float, str]:
        with self._lock:
            return bound_for(self.config, self._phase, list(self._times))

    def _arm_backstop(self) -> None:
        """The C-level last resort at twice the bound: stacks, then exit, GIL or not."""
        if self._thread is None:
            return
        bound, _ = self.bound()
        faulthandler.dump_traceback_later(2 * bound + self.config.grace_s, repeat=False, file=sys.stderr, exit=True)

    def _run(self) -> None:
        poll = max(0.05, min(1.0, self.config.floor_s / 20, self.config.heartbeat_s))
        last_beat = 0.0
        woke = time.monotonic()
        while not self._stop.wait(poll):
            late = time.monotonic() - woke - poll
            woke = time.monotonic()
            with self._lock:
                if late > STALL_S:  # this process did not run (stopped, starved): no idle time of its own
                    self._stalled += late
                idle, step, phase = woke - self._since - self._stalled, self._step, self._phase
            bound, why = self.bound()
            if time.monotonic() - last_beat >= self.config.heartbeat_s:
                last_beat = time.monotonic()
                self._heartbeat(step, phase, bound)
            if idle > bound:
                self._fire(idle, bound, why, step, phase)
                return

    def _record(self, step: int, phase: str, bound: float) -> dict[str, Any]:
        with self._lock:
            median = statistics.median(self._times) if self._times else None
            since, stalled = self._since_wall, self._stalled
        return {
            "stage": self.stage,
            "rank": self.rank,
            "host": self.host,
            "pid": self.pid,
            "start": self.start_ticks,  # the pid's kernel start time: a recycled pid is not this rank
            "step": step,
            "phase": phase,
            "bound_s": bound,
            "median_step_s": median,
            "last_progress": since,
            "stalled_s": stalled,  # of the time since then, what this process did not run
            "time": time.time(),
        }

    def _heartbeat(self, step: int, phase: str, bound: float) -> None:
        try:
            write_atomic(self.heartbeat_path, json.dumps(self._record(step, phase, bound)), durable=False)
        except OSError:
            pass  # a full or flaky disk must not end training; the step reads a stale heartbeat

    def _fire(self, idle: float, bound: float, why: str, step: int, phase: str) -> None:
        """Report, print every thread's stack, end this rank (EXIT_HUNG)."""
        record = self._record(step, phase, bound) | {"idle_s": idle, "why": why, "by": "rank watchdog"}
        # A rank whose heartbeat stopped is the one this rank waits on: named first
        frozen = frozen_ranks(self.out_dir, self.config.heartbeat_s, exclude=self.rank)
        if frozen:
            record["frozen"] = frozen
        try:
            write_atomic(self.hang_path, json.dumps(record, indent=2))
        except OSError:
            pass
        culprit = "".join(
            f"rank {f['rank']} on {f['host']} is frozen (its heartbeat is {f['silent_s']:.1f} s old: the "
            "process does not run); "
            for f in frozen
        )
        print(
            f"ERROR: {self.stage}: hang watchdog: {culprit}rank {self.rank} on {self.host} "
            f"{'waiting on it ' if frozen else ''}completed no step for "
            f"{idle:.1f} s after step {step} (bound {bound:.1f} s: {why}, phase {phase}); stacks of "
            "every thread follow, then this rank exits so the launch ends and its retry resumes "
            "from the last checkpoint",
            file=sys.stderr,
            flush=True,
        )
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(EXIT_HUNG)  # the main thread is stuck: no unwinding, no atexit
