"""The Prefect server `smollm3 run` starts for itself (infra/prefect_server.py `EmbeddedServer`):
waited for by the wall clock, stopped with the command, a failed start reported at once."""

from __future__ import annotations

import time

import psutil
import pytest

from infra.prefect_server import EmbeddedServer, ServerStartError, healthy


def test_the_server_answers_inside_the_block_and_is_gone_after(tmp_path):
    lines: list[str] = []
    with EmbeddedServer(home=str(tmp_path), timeout=600, log=lines.append) as server:
        assert healthy(server.api_url)
        pid = server.proc.pid
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert lines[0].startswith("starting a Prefect server for this run") and "up after" in lines[1]


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
