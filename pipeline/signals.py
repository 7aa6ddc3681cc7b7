"""SIGTERM and SIGINT stop a flow run at once, not after its running steps finish.

Prefect turns SIGTERM in a flow-run process into a `TerminationSignal` raised in the main thread
(and Python turns SIGINT into `KeyboardInterrupt`), but steps run in worker threads: each went on
waiting for its child (a curation, a trainer) while the flow's task runner waited for every worker,
so `smollm3 run` stopped minutes after Ctrl-C, once the running steps were done. While a run is
open (`stop_on_signals`, main thread only), the first SIGTERM or SIGINT:

1. calls `on_stop(signal name)` in a thread of its own: the run kills every child its steps started
   (`infra.proc.stop_all`: process groups and rank trees), so the steps waiting on them fail at
   once, and starts no further step;
2. then runs the handler that was installed before (Prefect's, or Python's), so the flow unwinds
   and records itself as cancelled;
3. arms a deadline: if the process still lives `deadline_s` later (a step working inside the flow
   process, such as an in-process evaluation, cannot be interrupted), `on_deadline()` records what
   it must, the exit hooks run (`atexit`) and the process exits with 128 + the signal number
   without waiting for the busy threads.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
DEADLINE_S = 8.0  # the run exits within this (plus `on_deadline`) of the first signal


@contextmanager
def stop_on_signals(
    on_stop: Callable[[str], object],
    on_deadline: Callable[[str], object],
    *,
    deadline_s: float = DEADLINE_S,
) -> Iterator[None]:
    """SIGTERM and SIGINT stop the run while in the block (see the module docstring); outside the
    main thread, where Python delivers no signal, a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    fired = threading.Event()
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}

    def handler(signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if not fired.is_set():
            fired.set()
            threading.Thread(target=on_stop, args=(name,), name="run-stop", daemon=True).start()
            threading.Thread(target=_deadline, args=(signum, name), name="run-deadline", daemon=True).start()
        before = previous[signum]
        if callable(before):
            before(signum, frame)
        elif signum == signal.SIGINT:
            raise KeyboardInterrupt
        else:
            raise SystemExit(128 + signum)

    def _deadline(signum: int, name: str) -> None:
        threading.Event().wait(deadline_s)
        try:
            log.error("run still busy %.0f s after %s: exiting", deadline_s, name)
            on_deadline(name)
            atexit._run_exitfuncs()  # what a normal exit runs (children, lineage, Prefect's server)
        finally:
            os._exit(128 + signum)

    for sig in STOP_SIGNALS:
        signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, before in previous.items():
            if signal.getsignal(sig) is handler:
                signal.signal(sig, before)
