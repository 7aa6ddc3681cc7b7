"""How far along a long piece of work is, in one format for every step: done/total, rate, ETA.

The trainer (trainers/pretrain.py), lm-eval (tasks/evaluate.py) and the post-training trainers
(trainers/posttrain/common.py) all say where they are the same way, so a Prefect task log reads
alike for every step:

    stage1 step 40/100 | loss 5.4321 | lr 2.40e-03 | grad 0.81 | 9,870 tok/s | MFU 23.4% | ETA 1m12s
    evaluate: 1,234/4,000 requests (31%) | prose_cloze 30/100 items, ... | ETA 1m20s

`Progress` counts units of work against a total and reports at most once per `every_pct`
percent or `every_s` seconds (every report is a log line and, in the UI, an artifact update), and
always at the end. Standard library only: `model/` uses it without Prefect.
"""

from __future__ import annotations

import time
from collections.abc import Callable


def duration(seconds: float | None) -> str:
    """`1h02m`, `3m05s`, `42s`; `?` when unknown."""
    if seconds is None or seconds != seconds or seconds < 0 or seconds == float("inf"):
        return "?"
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


def eta(done: float, total: float, elapsed: float) -> float | None:
    """Seconds left at the rate so far (None before any work is done)."""
    if done <= 0 or elapsed <= 0:
        return None
    return max(0.0, (total - done) * elapsed / done)


class Progress:
    """Reports `done` of `total` units through `log` (a line) and `report` (a percentage).

    A line is written when the percentage has moved by `every_pct` since the last line, or
    `every_s` seconds have passed with some progress, and once at the end (`done == total`).
    `detail()` adds a short text to each line (per-task counts, a loss)."""

    def __init__(
        self,
        what: str,
        total: int,
        unit: str,
        log: Callable[[str], None],
        report: Callable[[float], None] | None = None,
        *,
        every_pct: float = 10.0,
        every_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.what, self.total, self.unit = what, max(0, int(total)), unit
        self.log, self.report = log, report
        self.every_pct, self.every_s, self.clock = every_pct, every_s, clock
        self.done = 0
        self.started = clock()
        self._last_pct, self._last_t, self._last_done = 0.0, self.started, 0

    @property
    def percent(self) -> float:
        return 100.0 * self.done / self.total if self.total else 100.0

    def line(self, detail: str = "") -> str:
        elapsed = self.clock() - self.started
        left = eta(self.done, self.total, elapsed)
        parts = [f"{self.what}: {self.done:,}/{self.total:,} {self.unit} ({self.percent:.0f}%)"]
        if detail:
            parts.append(detail)
        parts.append(
            f"{'took' if self.done >= self.total else 'ETA'} {duration(elapsed if self.done >= self.total else left)}"
        )
        return " | ".join(parts)

    def advance(self, n: int = 1, detail: Callable[[], str] | None = None) -> None:
        """Count `n` more units done; maybe report. `total` may grow meanwhile (work announced
        in parts): the end is reported when `done` reaches the total of that moment."""
        self.done = min(self.total, self.done + n)
        if self.done == self._last_done:
            return
        now = self.clock()
        end = self.done >= self.total
        if end or self.percent - self._last_pct >= self.every_pct or now - self._last_t >= self.every_s:
            self._last_pct, self._last_t, self._last_done = self.percent, now, self.done
            self.log(self.line(detail() if detail else ""))
            if self.report is not None:
                self.report(self.percent)
