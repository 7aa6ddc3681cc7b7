"""Launching the all-reduce benchmark (`infra/preflight/allreduce.py`) under torchrun.

Bus bandwidth follows nccl-tests: algbw = bytes / time per all-reduce and
busbw = algbw * 2(n-1)/n, the per-link traffic of a ring all-reduce, comparable across rank counts.
The worker prints one `PREFLIGHT_ALLREDUCE {json}` line from rank 0; this module parses it.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from infra.preflight.commands import CommandRunner

MARK = "PREFLIGHT_ALLREDUCE "
REPO_ROOT = Path(__file__).resolve().parents[2]


def bus_bandwidth(algbw: float, world: int) -> float:
    """nccl-tests' bus bandwidth of an all-reduce over `world` ranks."""
    return algbw * 2 * (world - 1) / world if world > 1 else 0.0


@dataclass(frozen=True)
class AllReduceResult:
    busbw_gbps: float = 0.0
    algbw_gbps: float = 0.0
    seconds_per_op: float = 0.0
    world: int = 0
    error: str | None = None  # why no measurement came back


def allreduce_command(backend: str, nproc: int, mib: float, iters: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "infra.preflight.allreduce",
        "--backend",
        backend,
        "--mib",
        f"{mib:g}",
        "--iters",
        str(iters),
    ]


def parse_allreduce(stdout: str) -> dict | None:
    for line in stdout.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK) :])
    return None


def run_allreduce(
    commands: CommandRunner, backend: str, nproc: int, mib: float, iters: int, timeout: float
) -> AllReduceResult:
    """Run the benchmark on `nproc` local ranks; errors come back in `error`, never raised."""
    path = os.environ.get("PYTHONPATH", "")
    env = {
        # the repo need not be installed: the ranks import infra from the checkout
        "PYTHONPATH": str(REPO_ROOT) + (os.pathsep + path if path else ""),
        # one thread per rank: the ranks share the node's cores with each other
        "OMP_NUM_THREADS": "1",
    }
    out = commands.run(allreduce_command(backend, nproc, mib, iters), timeout=timeout, env=env)
    if out.timed_out:
        return AllReduceResult(
            error=f"torchrun did not finish in {timeout:g} s (killed): a hung rendezvous or collective"
        )
    data = parse_allreduce(out.stdout)
    if out.rc != 0 or data is None:
        tail = " | ".join((out.stderr or out.stdout).strip().splitlines()[-4:])
        return AllReduceResult(error=f"torchrun exited {out.rc}: {tail[-600:]}")
    if not data.get("correct", False):
        return AllReduceResult(error=f"all-reduce returned a wrong sum: {data}")
    return AllReduceResult(
        busbw_gbps=data["busbw_gbps"],
        algbw_gbps=data["algbw_gbps"],
        seconds_per_op=data["seconds_per_op"],
        world=data["world"],
    )
