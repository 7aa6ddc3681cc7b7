"""A private PostgreSQL server for tests: initdb into a temporary folder, pg_ctl start on a free port.

`local_postgres` (a pytest session fixture, imported by the tests that use it) makes sure Debian's
PostgreSQL is installed (apt-get when missing: needs root and the Debian mirror), creates a cluster
owned by the `postgres` system user (PostgreSQL refuses to run as root) with trust authentication
on 127.0.0.1 only, starts it, creates a database and yields its SQLAlchemy asyncpg URL. Teardown
stops exactly that server (`pg_ctl stop -m fast`) and deletes its folder.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGES = ["postgresql"]


@dataclass(frozen=True)
class Postgres:
    port: int
    database: str
    user: str
    bindir: Path

    @property
    def url(self) -> str:
        return f"postgresql+asyncpg://{self.user}@127.0.0.1:{self.port}/{self.database}"

    def sql(self, query: str) -> str:
        """Run `query` with psql and return its unaligned output."""
        proc = subprocess.run(
            [
                str(self.bindir / "psql"),
                "-h",
                "127.0.0.1",
                "-p",
                str(self.port),
                "-U",
                self.user,
                "-d",
                self.database,
                "-At",
                "-c",
                query,
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if proc.returncode != 0:
            raise AssertionError(f"psql {query!r} failed: {proc.stderr}")
        return proc.stdout.strip()


def _bindir() -> Path | None:
    versions = sorted(
        Path("/usr/lib/postgresql").glob("*/bin/initdb"),
        key=lambda p: int(p.parent.parent.name) if p.parent.parent.name.isdigit() else 0,
    )
    return versions[-1].parent if versions else None


def ensure_installed(timeout: float = 900) -> Path:
    bindir = _bindir()
    if bindir is not None:
        return bindir
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.fail(
            "PostgreSQL test needs Debian's postgresql package: `apt-get install -y postgresql` (as root), then rerun"
        )
    env = os.environ | {"DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update"], ["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES]):
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"`{' '.join(cmd)}` took over {timeout:.0f}s; is the Debian mirror reachable?")
        if proc.returncode != 0:
            pytest.fail(f"`{' '.join(cmd)}` failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    bindir = _bindir()
    if bindir is None:
        pytest.fail("postgresql installed but no /usr/lib/postgresql/*/bin/initdb found")
    return bindir


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def local_postgres():
    """A running PostgreSQL with database `prefect`, owned by this test session."""
    bindir = ensure_installed()
    root = Path(tempfile.mkdtemp(prefix="smollm3-pg-"))
    root.chmod(0o755)
    data, sockets = root / "data", root / "sock"
    data.mkdir()
    sockets.mkdir()
    prefix: list[str] = []
    if os.geteuid() == 0:  # postgres refuses to run as root: run it as the postgres user
        try:
            pw = pwd.getpwnam("postgres")
        except KeyError:
            pytest.fail("running as root but there is no `postgres` user to own the test cluster")
        for path in (root, data, sockets):
            os.chown(path, pw.pw_uid, pw.pw_gid)
        prefix = ["runuser", "-u", "postgres", "--"]
    port = _free_port()

    def run(cmd: list[str], timeout: float = 120) -> None:
        proc = subprocess.run(prefix + cmd, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            log = root / "server.log"
            tail = log.read_text()[-2000:] if log.exists() else ""
            pytest.fail(
                f"test PostgreSQL: `{' '.join(cmd)}` failed ({proc.returncode}):\n{proc.stderr[-2000:]}\n{tail}"
            )

    run([str(bindir / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust", "--no-sync", "-E", "UTF8"])
    started = False
    try:
        run(
            [
                str(bindir / "pg_ctl"),
                "-D",
                str(data),
                "-l",
                str(root / "server.log"),
                "-w",
                "-t",
                "60",
                "-o",
                f"-p {port} -k {sockets} -c listen_addresses=127.0.0.1 -c fsync=off",
                "start",
            ]
        )
        started = True
        run([str(bindir / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "postgres", "prefect"])
        yield Postgres(port=port, database="prefect", user="postgres", bindir=bindir)
    finally:
        if started:
            subprocess.run(
                prefix + [str(bindir / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop"],
                capture_output=True,
                timeout=60,
            )
        shutil.rmtree(root, ignore_errors=True)
