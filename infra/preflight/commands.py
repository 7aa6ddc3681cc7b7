"""The command layer of preflight: finding and running external programs (torchrun, dcgmi).

Checks call `ctx.commands.which(...)` and `ctx.commands.run(...)` instead of `subprocess`, so tests
inject a fake that answers like `dcgmi` or a torchrun job would. The real runner starts each command
in its own process group and kills the whole group on timeout: a hung NCCL job leaves torchrun and
every rank behind otherwise.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class CommandOutput:
    rc: int  # exit status (-1 when killed on timeout)
    stdout: str
    stderr: str
    timed_out: bool = False


class CommandRunner(Protocol):
    def which(self, program: str) -> str | None: ...

    def run(self, args: Sequence[str], timeout: float, env: Mapping[str, str] | None = None) -> CommandOutput: ...


class SubprocessRunner:
    """Runs real commands; `env` entries are added to the current environment."""

    def which(self, program: str) -> str | None:
        return shutil.which(program)

    def run(self, args: Sequence[str], timeout: float, env: Mapping[str, str] | None = None) -> CommandOutput:
        full_env = {**os.environ, **(env or {})}
        proc = subprocess.Popen(
            list(args),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=full_env,
            start_new_session=True,
        )
        try:
            out, err = proc.communicate(timeout=timeout)
            return CommandOutput(proc.returncode, out, err)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            out, err = proc.communicate()
            return CommandOutput(-1, out, err, timed_out=True)
