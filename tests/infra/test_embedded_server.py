"""The Prefect server `smollm3 run` starts for itself (infra/prefect_server.py `EmbeddedServer`):
waited for by the wall clock, stopped with the command, a failed start reported at once."""

from __future__ import annotations

import time

import psutil
import pytest

from infra.prefect_server import EmbeddedServer, ServerStartError, healthy


@pytest.mark.slow
def test_the_server_answers_inside_the_block_and_is_gone_after(tmp_path):
    lines: list[str] = []
    with EmbeddedServer(home=str(tmp_path), timeout=600, log=lines.append) as server:
        assert healthy(server.api_url)
        pid = server.proc.pid
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert lines[0].startswith("starting a Prefect server for this run") and "up after" in lines[1]


@pytest.mark.slow
def test_a_server_that_cannot_start_is_reported_at_once_with_its_output(tmp_path):
    """Its database cannot be opened (PREFECT_HOME below a file): the error comes when the
    server exits, with its own message, not after the deadline."""
    (tmp_path / "file").write_text("")
    started = time.monotonic()
    with pytest.raises(ServerStartError, match="exited with code") as err:
        with EmbeddedServer(home=str(tmp_path / "file" / "home"), timeout=600, log=lambda _: None):
            pass
    assert "unable to open database file" in str(err.value)
    assert time.monotonic() - started < 300  # far inside the 600 s deadline


@pytest.mark.slow
def test_the_server_dies_with_the_process_that_started_it(tmp_path):
    """SIGKILL the command that started it (no cleanup of its own runs): the guard ends the server."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    code = (
        "import sys, time\nfrom infra.prefect_server import EmbeddedServer\n"
        f"with EmbeddedServer(home={str(tmp_path)!r}, log=lambda line: print(line, flush=True)) as s:\n"
        "    print('pid', s.proc.pid, s.api_url, flush=True)\n    time.sleep(600)\n"
    )
    owner = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=repo,
        env={**os.environ, "PYTHONPATH": str(repo)},
        stdout=subprocess.PIPE,
        text=True,
    )
    server: list[psutil.Process] = []
    try:
        line = ""
        while not line.startswith("pid "):
            line = owner.stdout.readline()
            assert line or owner.poll() is None, "the server did not start"
        _, guard, url = line.split()
        server += [p for p in psutil.Process(int(guard)).children(recursive=True) if "server" in " ".join(p.cmdline())]
        assert server and healthy(url)
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait()
        gone, alive = psutil.wait_procs(server, timeout=60)
        assert not alive, f"server outlived its owner: {alive}"
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
        for proc in server:  # a server the guard failed to end does not outlive the test
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
