"""Faults injected into a running launch from outside it (the marathon tests and benchmark)."""

from __future__ import annotations

import signal
import threading
import time

import psutil


class Throttle:
    """A CPU quota put on one process from outside, as CFS bandwidth control throttles a container
    (cpu.max): it runs `run_ms` of every `period_ms` and is stopped (SIGSTOP) for the rest.

    A busy neighbour (a spinner on the rank's CPU, a lower priority) slows a rank by an amount
    that depends on everything else the machine runs: on a loaded machine the other ranks are
    slowed too, and the slowed one may not stand out. A quota slows it by the same factor (about
    `period_ms / run_ms`) however loaded the machine is. `stop()` lets it run freely again."""

    def __init__(self, proc: psutil.Process, run_ms: float = 20.0, period_ms: float = 100.0) -> None:
        if not 0 < run_ms < period_ms:
            raise ValueError(f"run_ms must be in (0, period_ms); got {run_ms} of {period_ms}")
        self.proc = proc
        self.factor = period_ms / run_ms
        self._run_s, self._off_s = run_ms / 1e3, (period_ms - run_ms) / 1e3
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._cycle, name="throttle", daemon=True)
        self.started_at = time.time()
        self._thread.start()

    def _cycle(self) -> None:
        try:
            while not self._stop.is_set():
                self.proc.send_signal(signal.SIGSTOP)
                self._stop.wait(self._off_s)
                self.proc.send_signal(signal.SIGCONT)
                self._stop.wait(self._run_s)
        except psutil.NoSuchProcess:
            return
        finally:
            try:
                self.proc.send_signal(signal.SIGCONT)
            except psutil.NoSuchProcess:
                pass

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
