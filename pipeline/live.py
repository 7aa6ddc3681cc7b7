"""What a running step says now, in the Prefect API: its percentage and its latest progress line.

Training stages, evaluations and post-training trainers log one progress line format
(infra/progress.py): `stage1 step 40/100 | loss 5.4321 | ... | 9,870 tok/s | ETA 1m12s`,
`lm-eval: 1,234/4,000 items (31%) | prose_cloze 30/100 items | ETA 1m20s`. Those lines went to
the task log only, so the demo terminal (and anyone without the UI's log tab open) saw 10%
marks. `LiveStatus` keeps, for one build, a Prefect progress artifact whose value is the step's
percentage (the one its latest progress line states, `step 40/100` is 40%, so the two never
disagree; the step's own `progress()` where no line states one) and whose description is its
key and its latest progress line:

    pretrain[stage2]

    stage2 step 40/100 | loss 5.4321 | lr 2.40e-03 | grad 0.812 | 9,870 tok/s | ETA 1m12s

`smollm3 watch` and the demo read it (flows/watch.py); the UI shows it on the run's Artifacts tab.
A line updates the artifact at most every `every_s` seconds (a line that came sooner is sent
when the interval is over, so the artifact is never more than `every_s` behind). A failed update is dropped: publishing what a step says never fails it.
"""

from __future__ import annotations

import contextvars
import logging
import re
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

# A progress line: `... | ETA 1m12s` while it runs, `... | took 3m05s` at its end.
_STATUS = re.compile(r"\| (ETA|took) \S+\s*$")


def is_status(line: str) -> bool:
    """Whether a log line is a progress line (infra/progress.py's format)."""
    return bool(_STATUS.search(line))


# The first `done/total` of a progress line: `step 8/16`, `lm-eval: 26/251 items`.
_FRACTION = re.compile(r"(\d[\d,]*)\s*/\s*(\d[\d,]*)")


def line_percent(line: str) -> float | None:
    """The percentage a progress line states by its first `done/total` (None: it states none).
    The artifact shows this one, so its percentage and its line never disagree."""
    m = _FRACTION.search(line)
    if not m:
        return None
    done, total = (int(g.replace(",", "")) for g in m.groups())
    return 100.0 * min(done, total) / total if total else None


def describe(key: str, line: str) -> str:
    """The artifact description: the step key, then its latest progress line."""
    return f"{key}\n\n{line}" if line else key


def parse(description: str | None) -> tuple[str, str]:
    """(step key, latest progress line) of a description written by `describe`."""
    key, _, line = (description or "").partition("\n\n")
    return key.strip(), line.strip()


class LiveStatus:
    """One build's progress artifact: `progress(percent)`, `log(line)` (`wrap` a log callback so
    its progress lines reach the artifact), `finish()` at 100%."""

    def __init__(self, key: str, artifact_key: str, every_s: float = 2.0, clock: Callable[[], float] = time.monotonic):
        from prefect.artifacts import create_progress_artifact

        self.key, self.every_s, self.clock = key, every_s, clock
        self.percent, self.line = 0.0, ""
        self._sent: tuple[float, str] | None = (0.0, "")
        self._last = -float("inf")
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self.artifact_id = create_progress_artifact(progress=0.0, key=artifact_key, description=key)
        # The step's Prefect context (its API's settings among it): updates come from threads the
        # step starts (a stage's metrics watcher, the timer below), which have none, and Prefect
        # would start a temporary server of its own for them instead of reaching the run's API.
        self._context = contextvars.copy_context()

    def _send(self, force: bool = False) -> None:
        with self._lock:
            now = self.clock()
            state = (self.percent, self.line)
            if state == self._sent:
                return
            if not force and now - self._last < self.every_s:
                if self._timer is None:  # the latest line goes out when the interval is over
                    self._timer = threading.Timer(self.every_s - (now - self._last), self._flush)
                    self._timer.daemon = True
                    self._timer.start()
                return
            self._sent, self._last = state, now
        try:
            from prefect.artifacts import update_progress_artifact

            self._context.copy().run(  # a copy: one context is entered by one thread at a time
                update_progress_artifact,
                artifact_id=self.artifact_id,
                progress=state[0],
                description=describe(self.key, state[1]),
            )
        except Exception as exc:  # noqa: BLE001 - the API is busy or gone: the step goes on
            log.debug("progress artifact of %s not updated: %s", self.key, exc)

    def _flush(self) -> None:
        with self._lock:
            self._timer = None
        self._send(force=True)

    def progress(self, percent: float) -> None:
        if line_percent(self.line) is not None:
            return  # the latest line says how far the step is: its percentage is shown
        self.percent = max(0.0, min(100.0, float(percent)))
        self._send(force=not self.line)  # a bare percentage (no line yet) is sent as it comes

    def log(self, line: str) -> None:
        if is_status(line):
            self.line = line.strip()
            stated = line_percent(self.line)
            if stated is not None:
                self.percent = stated
            self._send()

    def wrap(self, sink: Callable[[str], None]) -> Callable[[str], None]:
        def both(line: str) -> None:
            sink(line)
            self.log(line)

        return both

    def finish(self) -> None:
        """A finished build is done, whatever its last report said."""
        self.percent = 100.0
        self._send(force=True)
