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
   process, such as an in-process evaluation, cannot be interrupted, and exiting itself can be slow
   on a loaded machine), `on_deadline()` records what it must, the exit hooks run (`atexit`, for
   at most `hooks_s`) and the process exits with 128 + the signal number without waiting for the
   busy threads: 8 s after the signal at the latest.
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
DEADLINE_S = 6.0  # a run still alive this long after the first signal exits...
HOOKS_S = 2.0  # ...after at most this long for `on_deadline` and the exit hooks


@contextmanager
def stop_on_signals(
    on_stop: Callable[[str], object],
    on_deadline: Callable[[str], object],
    *,
    deadline_s: float = DEADLINE_S,
    hooks_s: float = HOOKS_S,
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
        log.error("run still busy %.0f s after %s: exiting", deadline_s, name)

        def last_words() -> None:
            on_deadline(name)
            atexit._run_exitfuncs()  # what a normal exit runs (children, lineage, Prefect's server)

        # Bounded: a normal exit may be running the same hooks (stopping a temporary Prefect
        # server can take seconds on a loaded machine); the process ends either way.
        helper = threading.Thread(target=last_words, name="run-exit-hooks", daemon=True)
        helper.start()
        helper.join(hooks_s)
        os._exit(128 + signum)

    for sig in STOP_SIGNALS:
        signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, before in previous.items():
            if signal.getsignal(sig) is handler:
                signal.signal(sig, before)
