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
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

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


@LAUNCHERS.register("local")
class LocalTorchrun(Launcher):
    """One node, N ranks, torchrun's static rendezvous on 127.0.0.1."""

    def command(self, spec_path: Path, port: int | None = None) -> list[str]:
        c = self.config
        if c.nodes != 1:
            raise ValueError(
                f"launch.nodes={c.nodes} with kind local: the local launcher runs on this machine "
                "only; use kind slurm or kubernetes for several nodes"
            )
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

    def render(self, spec_path: Path, workdir: Path) -> str:
        return shlex.join(self.command(Path(spec_path), port=self.config.master_port or 29500))

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
            cmd = self.command(spec_path)
            log(f"[launch] {shlex.join(cmd)}")
            first, summary = FirstError(), TorchrunSummary()

            def stream(line: str, first=first, summary=summary) -> None:
                first.feed(line)
                summary.feed(line)
                log(line)

            try:
                run_streaming(cmd, stream, cwd=self.config.code_path, env=self.env(), on_start=on_start)
                return
            except ChildFailed as exc:
                # The picked port was free when asked and taken before the rendezvous bound it
                # (another launch on this machine): no rank started, so a new port is safe.
                if c.master_port or attempt == PORT_ATTEMPTS or not _port_taken(exc.tail):
                    failed = exc
                    break
                log(
                    f"[launch] rendezvous port taken before torchrun bound it; retrying on a new port ({attempt}/{PORT_ATTEMPTS})"
                )
        # No summary when torchrun itself was killed: then its own status is the cause.
        facts = failure_facts(spec_path, Path(workdir), summary, first, failed.returncode, who="torchrun")
        raise LaunchFailed(
            f"local {'accelerate' if c.accelerate_config else 'torchrun'} of {spec_path} failed",
            failed.tail,
            first.line,
            facts,
        ) from failed
