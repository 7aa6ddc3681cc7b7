"""The default launcher: torchrun on this machine, through infra.proc.run_streaming.

`torchrun --nnodes 1 --nproc-per-node N --master-port P -m trainers.pretrain SPEC.json`, started in its
own process group so a failed, interrupted or cancelled task kills every rank with it. A free port
is picked per launch (fixed ports collide when two stages or test runs share a machine); when
another process takes it before torchrun binds it, the launch retries on a new port. With
`accelerate_config`, `accelerate launch --config_file FILE --num_machines 1 --num_processes N
--main_process_port P -m MODULE SPEC.json` instead (accelerate starts the ranks through
torch.distributed.run: the same ranks, sessions and failure summary). The environment carries
the stop signals torchrun forwards to the ranks and how long it waits for their checkpoint
(infra/launchers/fabric.py `launch_env`), so a SIGTERM or SIGUSR1 to torchrun saves the step
being trained (trainers/rank_signals.py); the flow process dying still takes the ranks along.

One process on one node (the tiny recipe's every stage and post-training trainer) skips torchrun:
`python -u -m MODULE SPEC.json` runs directly under the guard with the environment torchrun gives
a rank (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, ROLE_RANK, MASTER_ADDR,
MASTER_PORT, ...), so the trainer takes the same code path (its process group over a TCPStore it
serves itself on the picked port) and trains the same bits. torchrun's elastic agent, a second
Python process importing torch before the rank can start, had nothing to coordinate for one rank:
a stop signal reaches the rank with the guard's process group (the rank saves its step and exits
75), the guard's parent-death signal and `protect_rank` end it with the guard, and the failure is
read from the guard's status: the rank's exit code passes through, and a rank killed by a signal
is named from the guard's `command killed by SIG...` line (torchrun's failure summary otherwise).
Several ranks, several nodes or `accelerate_config` keep torchrun (or accelerate).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from infra.guard import COMMAND_KILLED
from infra.launchers.base import (
    LAUNCHERS,
    FirstError,
    Launcher,
    LaunchFailed,
    LogFn,
    OnStart,
    TorchrunSummary,
    accelerate_args,
    check_spec,
    failure_facts,
    free_port,
)
from infra.launchers.fabric import launch_env
from infra.proc import ChildFailed, kill_group, run_streaming

PORT_ATTEMPTS = 3


def _port_taken(tail: list[str]) -> bool:
    """torchrun's agent failed to bind the picked rendezvous port (before any rank started)."""
    text = "\n".join(tail)
    return "EADDRINUSE" in text and ("TCPStore" in text or "rendezvous" in text)


class DirectSummary(TorchrunSummary):
    """What a one-process launch without torchrun (`direct`) says of how its rank ended, read like
    torchrun's failure summary: rank 0, its exit code (the guard passes it through) or the signal
    that killed it (the guard's `command killed by SIG...` line). Nothing when the guard itself
    was stopped or killed (its owner died, a kill of the whole group): then its status is the cause."""

    _KILLED = re.compile(rf"^\[lifeline\] {COMMAND_KILLED} (SIG[A-Z0-9]+)\b")

    def __init__(self) -> None:
        super().__init__()
        self.killed_by: str | None = None
        self.guard_stopped = False

    def feed(self, line: str) -> None:
        text = line.strip()
        if m := self._KILLED.match(text):
            self.killed_by = m.group(1)
        elif text.startswith("[lifeline] "):  # the guard stopping its command, or refusing to start it
            self.guard_stopped = True

    def settle(self, returncode: int) -> None:
        """Fill the summary's fields once the guard's status is known."""
        if self.guard_stopped:
            return
        if returncode < 0 and self.killed_by is not None:
            self.fields = {"rank": "0", "exitcode": f"{returncode} ({self.killed_by})"}
        elif returncode > 0:
            self.fields = {"rank": "0", "exitcode": str(returncode)}


@LAUNCHERS.register("local")
class LocalTorchrun(Launcher):
    """One node, N ranks, torchrun's static rendezvous on 127.0.0.1."""

    @property
    def direct(self) -> bool:
        """One rank on this machine, no accelerate: the rank runs under the guard without torchrun."""
        return self.config.direct

    def command(self, spec_path: Path, port: int | None = None) -> list[str]:
        c = self.config
        if c.nodes != 1:
            raise ValueError(
                f"launch.nodes={c.nodes} with kind local: the local launcher runs on this machine "
                "only; use kind slurm or kubernetes for several nodes"
            )
        if self.direct:  # the port is the rank's own (`rank_env`)
            return [sys.executable, "-u", "-m", c.module, str(spec_path)]
        port = port or c.master_port or free_port()
        if c.accelerate_config:
            # `make` runs .venv/bin/smollm3 without the venv on PATH: this interpreter's accelerate.
            accelerate = (
                [c.accelerate] if shutil.which(c.accelerate) else [sys.executable, "-m", "accelerate.commands.launch"]
            )
            args = accelerate_args(c)
            if accelerate[-1] == "accelerate.commands.launch":
                args = args[1:]  # the module is the `launch` subcommand itself
            return [*accelerate, *args, "--main_process_port", str(port), "-m", c.module, str(spec_path)]
        torchrun = [c.torchrun] if shutil.which(c.torchrun) else [sys.executable, "-m", "torch.distributed.run"]
        return [
            *torchrun,
            "--nnodes",
            "1",
            "--nproc-per-node",
            str(c.procs_per_node),
            "--master-port",
            str(port),
            "-m",
            c.module,
            str(spec_path),
        ]

    def env(self) -> dict[str, str]:
        code = str(self.config.code_path)
        path = os.environ.get("PYTHONPATH")
        c = self.config
        return {
            # torchrun sets OMP_NUM_THREADS=1 for N > 1 anyway; say it once, quietly
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            # stop signals and their grace, NCCL error handling (one node: no rank labels needed)
            **launch_env(c.fabric, c.rendezvous, labels=False),
            **c.env,
            "PYTHONPATH": f"{code}{os.pathsep}{path}" if path else code,
        }

    def rank_env(self, port: int) -> dict[str, str]:
        """A direct launch's rank environment: what torchrun gives rank 0 of a one-process launch
        (less its agent's own variables: the rank serves its rendezvous store itself)."""
        one = {name: "1" for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE")}
        zero = {name: "0" for name in ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK")}
        return {**zero, **one, "ROLE_NAME": "default", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}

    def render(self, spec_path: Path, workdir: Path) -> str:
        port = self.config.master_port or 29500
        cmd = shlex.join(self.command(Path(spec_path), port=port))
        if self.direct:
            return " ".join(f"{k}={v}" for k, v in self.rank_env(port).items()) + " " + cmd
        return cmd

    # -- a helper pool: one process per "node", on this machine, in a session of its own --

    def pool_commands(self, pool, parent: int | None = None) -> list[list[str]]:
        """Each node's command; `parent`: the pid the nodes end with (`pool.parent_arg`)."""
        tail = [pool.parent_arg, str(parent)] if parent is not None and pool.parent_arg else []
        return [pool.argv(sys.executable, str(node)) + tail for node in range(pool.nodes)]

    def render_pool(self, pool, workdir: Path) -> str:
        return "\n".join(shlex.join(cmd) for cmd in self.pool_commands(pool)) + "\n"

    def submit_pool(self, pool, workdir: Path, log: LogFn = print) -> str:
        """The nodes as children of this process (they end with it: `pool.parent_arg`), each in
        a session of its own, their output appended to `{workdir}/{name}-pool.log`."""
        if not hasattr(self, "_pools"):
            self._pools: dict[str, list[subprocess.Popen]] = {}
        logfile = Path(workdir) / f"{pool.name}-pool.log"
        logfile.parent.mkdir(parents=True, exist_ok=True)
        procs = []
        with open(logfile, "ab") as out:
            for cmd in self.pool_commands(pool, parent=os.getpid()):
                procs.append(
                    subprocess.Popen(
                        cmd,
                        cwd=self.config.code_path,
                        env={**os.environ, **self.env()},
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        start_new_session=True,
                    )
                )
        handle = ",".join(str(p.pid) for p in procs)
        self._pools[handle] = procs
        return handle

    def pool_state(self, pool, handle: str) -> str | None:
        for node, proc in enumerate(self._pools[handle]):
            code = proc.poll()
            if code is None:
                continue
            if code == 0 and all(p.poll() == 0 for p in self._pools[handle]):
                return "completed"
            if code != 0:
                how = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
                return f"ended: node {node} (pid {proc.pid}) {how}"
        return None

    def cancel_pool(self, pool, handle: str, workdir: Path) -> None:
        for proc in self._pools.pop(handle, []):
            kill_group(proc, grace=10.0)

    def describe_pool(self, pool, handle: str) -> str:
        n = "1 process" if pool.nodes == 1 else f"{pool.nodes} processes"
        return f"local {pool.name} pool ({n}, pid {handle})"

    def launch(self, spec_path: Path, workdir: Path, log: LogFn = print, *, on_start: OnStart = None) -> None:
        spec_path = check_spec(spec_path)
        Path(workdir).mkdir(parents=True, exist_ok=True)
        c = self.config
        if c.accelerate_config and not (c.code_path / c.accelerate_config).is_file():
            raise FileNotFoundError(
                f"launch.accelerate_config {c.accelerate_config} does not exist (relative paths "
                f"are read from {c.code_path}); write one with `accelerate config` or use the "
                "examples in configs/accelerate/"
            )
        for attempt in range(1, PORT_ATTEMPTS + 1):
            if self.direct:
                port = c.master_port or free_port()
                cmd, env = self.command(spec_path), {**self.env(), **self.rank_env(port)}
                log(f"[launch] MASTER_PORT={port} {shlex.join(cmd)}  (one rank: no torchrun)")
            else:
                cmd, env = self.command(spec_path), self.env()
                log(f"[launch] {shlex.join(cmd)}")
            first = FirstError()
            summary = DirectSummary() if self.direct else TorchrunSummary()

            def stream(line: str, first=first, summary=summary) -> None:
                first.feed(line)
                summary.feed(line)
                log(line)

            try:
                run_streaming(cmd, stream, cwd=self.config.code_path, env=env, on_start=on_start)
                return
            except ChildFailed as exc:
                # The picked port was free when asked and taken before the rendezvous bound it
                # (another launch on this machine): no rank trained (a direct rank fails binding
                # its store before it writes anything), so a new port is safe.
                if c.master_port or attempt == PORT_ATTEMPTS or not _port_taken(exc.tail):
                    failed = exc
                    break
                log(
                    f"[launch] rendezvous port taken before torchrun bound it; retrying on a new port ({attempt}/{PORT_ATTEMPTS})"
                )
        # No summary when torchrun (or the direct rank's guard) itself was killed: then its own
        # status is the cause.
        if isinstance(summary, DirectSummary):
            summary.settle(failed.returncode)
        who = "the guard of rank 0" if self.direct else "torchrun"
        facts = failure_facts(spec_path, Path(workdir), summary, first, failed.returncode, who=who)
        starter = "accelerate" if c.accelerate_config else ("run" if self.direct else "torchrun")
        raise LaunchFailed(
            f"local {starter} of {spec_path} failed",
            failed.tail,
            first.line,
            facts,
        ) from failed
