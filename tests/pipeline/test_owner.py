"""The serve process as a run's owner (pipeline/owner.py): who counts as the owner, and a console whose
reader died. The whole story (a served run whose serve process is SIGKILLed ends Crashed, saying
so, and resumes on retry) is exercised by tests/flows/test_chaos.py."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from infra.guard import ProcessRef
from pipeline.owner import OWNER_ENV, run_owner

REPO = Path(__file__).resolve().parents[2]


def test_the_owner_is_the_serve_process_that_started_this_one():
    parent = ProcessRef.of(os.getppid())
    assert run_owner({OWNER_ENV: parent.encode()}) == parent
    assert run_owner({}) is None
    assert run_owner({OWNER_ENV: "garbage"}) is None
    # a live process that is not our parent (the variable inherited further down): not ours
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert run_owner({OWNER_ENV: ProcessRef.of(other.pid).encode()}) is None
    finally:
        other.kill()
        other.wait()
    # an owner that already died (pid and start time no longer match): ours, and dead
    gone = run_owner({OWNER_ENV: f"{other.pid}:{ProcessRef.of(os.getpid()).start}"})
    assert gone is not None and gone.alive() is False


CHILD = textwrap.dedent("""
    import logging, os, sys, time
    from prefect.logging.handlers import PrefectConsoleHandler
    logger = logging.getLogger("prefect.test-owner")
    logger.addHandler(PrefectConsoleHandler(stream=sys.stderr))
    logger.propagate = False
    if sys.argv[1] == "patched":
        from pipeline.owner import survive_broken_console
        survive_broken_console()
    logger.warning("first line, read")
    sys.stdin.readline()  # the reader closes its end of the pipe, then says go on stdin
    try:
        for i in range(3):
            logger.warning("nobody reads this %d", i)
    except SystemExit:
        os.write(int(sys.argv[2]), b"SystemExit")
        raise
    os.write(int(sys.argv[2]), b"survived")
""")


def _log_into_a_closed_pipe(mode: str) -> tuple[str, int]:
    out_r, out_w = os.pipe()
    res_r, res_w = os.pipe()
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, mode, str(res_w)],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stderr=out_w,
        pass_fds=(res_w,),
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    os.close(out_w)
    os.close(res_w)
    with os.fdopen(out_r, "rb") as reader:
        assert b"first line, read" in reader.readline()
    # the console's reader is gone (as when the serve process dies)
    proc.stdin.write(b"go\n")
    proc.stdin.close()
    code = proc.wait(60)
    with os.fdopen(res_r, "rb") as res:
        return res.read().decode(), code


def test_a_console_whose_reader_died_no_longer_raises_systemexit_in_the_logging_thread():
    said, code = _log_into_a_closed_pipe("stock")
    assert said == "SystemExit" and code == 1  # rich's on_broken_pipe: what ended runs mid-step
    said, code = _log_into_a_closed_pipe("patched")
    assert said == "survived" and code == 0
