"""Faults injected into a running launch from outside it (the marathon tests and benchmark)."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import psutil

# cgroup v1's cpu controller, or the unified hierarchy when it offers `cpu`
_V1 = Path("/sys/fs/cgroup/cpu")
_V2 = Path("/sys/fs/cgroup")


class Throttle:
    """A CPU quota put on one process from outside, as a throttled container or a host whose
    cores are shared: the process runs `share` of every `period_ms` (all its threads together).

    A busy neighbour (a spinner on the rank's CPU, a lower priority) slows a rank by an amount
    that depends on everything else the machine runs: on a loaded machine the other ranks are
    slowed too, and the slowed one may not stand out. A quota slows it by about `1 / share`
    however loaded the machine is. The kernel's CFS bandwidth control does it where this process
    may make a cgroup (root; cgroup v1 `cpu.cfs_quota_us` or v2 `cpu.max`); elsewhere a thread
    here stops and continues the process (SIGSTOP/SIGCONT) on the same period, at the highest
    priority it is allowed. `how` says which; `stop()` lets the process run freely again.

    The quota is the kernel's smallest (1 ms of every 8) because what names a straggler is the
    rank's own 2 ms sections (data, optimizer; trainers/monitor.py), run after it waited in a
    collective with its quota unspent: a section shorter than the quota runs at full speed (at
    2 ms of every 10, half of them did), one longer is stopped for the rest of the period. The
    signals cannot keep a 1 ms beat on a loaded machine: they stop it for 35 ms of every 40
    (`signal_period_ms`), which slows 2 ms sections by about as much on average, less evenly."""

    def __init__(
        self, proc: psutil.Process, share: float = 0.125, period_ms: float = 8.0, signal_period_ms: float = 40.0
    ) -> None:
        if not 0 < share < 1:
            raise ValueError(f"share must be in (0, 1); got {share}")
        self.proc, self.share, self.period_ms, self.signal_period_ms = proc, share, period_ms, signal_period_ms
        self.started_at = time.time()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._group = self._cgroup()
        if self._group is not None:
            self.how = f"cgroup {self._group}"
            return
        self.how = "SIGSTOP/SIGCONT"
        self._thread = threading.Thread(target=self._cycle, name="throttle", daemon=True)
        self._thread.start()

    # -- the kernel's quota --

    def _cgroup(self) -> Path | None:
        period_us = int(self.period_ms * 1000)
        quota_us = max(1000, int(period_us * self.share))  # the kernel's minimum quota is 1 ms
        name = f"smollm3-throttle-{os.getpid()}-{self.proc.pid}"
        for root, settings in (
            (_V1, {"cpu.cfs_period_us": str(period_us), "cpu.cfs_quota_us": str(quota_us)}),
            (_V2, {"cpu.max": f"{quota_us} {period_us}"}),
        ):
            if root == _V2 and "cpu" not in _read(root / "cgroup.subtree_control").split():
                continue
            if not (root / "cgroup.procs").exists():
                continue
            group = root / name
            try:
                group.mkdir(exist_ok=True)
                for key, value in settings.items():
                    (group / key).write_text(value)
                (group / "cgroup.procs").write_text(str(self.proc.pid))  # every thread of it, and its future ones
                return group
            except OSError:
                _remove(group, root)
        return None

    # -- signals, where no cgroup can be made --

    def _cycle(self) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), -10)
        except OSError:
            pass  # not allowed: the default priority
        run_s = self.signal_period_ms * self.share / 1e3
        off_s = self.signal_period_ms / 1e3 - run_s
        try:
            while not self._stop.is_set():
                self.proc.send_signal(signal.SIGSTOP)
                self._stop.wait(off_s)
                self.proc.send_signal(signal.SIGCONT)
                self._stop.wait(run_s)
        except psutil.NoSuchProcess:
            return
        finally:
            try:
                self.proc.send_signal(signal.SIGCONT)
            except psutil.NoSuchProcess:
                pass

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._group is not None:
            _remove(self._group, self._group.parent)


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _remove(group: Path, root: Path) -> None:
    """Move what is left in `group` back to `root` and delete it (an ended process has left)."""
    for pid in _read(group / "cgroup.procs").split():
        try:
            (root / "cgroup.procs").write_text(pid)
        except OSError:
            pass
    try:
        group.rmdir()
    except OSError:
        pass
