"""infra/exit.py: `exit_process` ends a process as `sys.exit` does, final collections left out."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CHILD = """
import atexit, sys, threading, time
from infra.exit import exit_process

def late():
    time.sleep(0.3)
    print("thread joined", flush=True)

atexit.register(lambda: print("exit handler ran"))
threading.Thread(target=late).start()  # not a daemon: the interpreter waits for it
sys.stdout.write("buffered, unflushed")
sys.stdout.write("\\n")
exit_process(int(sys.argv[1]))
"""


def test_exit_process_keeps_the_code_exit_handlers_thread_joins_and_buffered_output():
    for code in (0, 3):
        proc = subprocess.run(
            [sys.executable, "-c", CHILD, str(code)], cwd=REPO, capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == code, proc.stderr
        assert proc.stdout.splitlines() == ["buffered, unflushed", "thread joined", "exit handler ran"], proc.stdout
