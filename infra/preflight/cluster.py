"""The preflight job: the node checks on every node of a training stage's allocation (Slurm).

A flow process on a login node has no GPUs, and a flow process on one GPU node sees one node of
48; the checks that concern a node (groups `gpu`, `compute`, `host`, `storage`: GPU stress,
throttling, memory patterns, ECC, DCGM when installed, the node's NCCL/gloo all-reduce, the
open-file limit, host memory, write and read on the real checkpoint path) must run where training
runs. So, for a Slurm launch, the preflight step (tasks/preflight.py) submits one job the size
and shape of the first stage's (`render_slurm`: its nodes, GPUs, CPUs, memory, partition,
account, exclusive nodes, setup lines and fabric environment, minus the nodes already excluded)
that runs, with one task per node,

    python -m infra.preflight --config C --facts F --node "$SLURMD_NODENAME" --json nodes/NODE.json

and then one all-reduce across all the nodes' ranks (`torchrun --nnodes N` of
infra/preflight/allreduce.py, NCCL on GPUs, gloo on CPUs; its record in `allreduce.json`). Each
node writes its report atomically, so a report is whole or absent. `run_preflight_job` submits,
follows the job's log and collects a `JobOutcome`: each node of the allocation (from Slurm, not
from the files, so a node that crashed, hung or was killed before writing is seen) with its
results or none. The recipe-level checks (config review, data) need no node and run once, in the
flow process (`split_config`).

What the step does with the outcome: per-node rows named `check@node` in its report and lineage
(`rows`), the nodes to exclude (`bad_nodes`: a node whose own checks would stop training, or that
wrote no report), recorded through infra/launchers/exclude.py so the run's training jobs keep away
from them.

At the 3B recipe's scale (48 nodes): 48 reports of about 20 rows (~10 KB each, ~0.5 MB in all), read
once by the flow process; the job takes the node checks' time (~30 s of GPU stress, DCGM level 1
in seconds) plus one torchrun rendezvous of 384 ranks.
"""

from __future__ import annotations

import collections
import json
import re
import shlex
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from infra.files import read_json, write_json_atomic
from infra.launchers.base import LaunchConfig, LaunchFailed
from infra.launchers.fabric import launch_env
from infra.launchers.follow import following
from infra.launchers.slurm import DONE, FAILED, JobGone, SlurmLauncher, job_port, sbatch_resources
from infra.preflight.core import CHECKS, CheckResult, PreflightConfig, PreflightFacts, blocking, selected, should_stop

NODE_GROUPS = ("gpu", "compute", "host", "storage")  # checks about a node: they run on every node
NODES_DIR = "nodes"  # {out}/nodes/{node}.json: one report per node
ALLREDUCE_JSON = "allreduce.json"  # the all-reduce across the allocation's nodes
JOB_TIME = "01:00:00"  # the job's time limit: DCGM level 3 takes up to 30 min, the rest minutes
Runner = Callable[..., subprocess.CompletedProcess]


def _run(cmd: Sequence[str], input: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), input=input, capture_output=True, text=True, timeout=120)


def split_config(config: PreflightConfig) -> tuple[PreflightConfig, PreflightConfig]:
    """(the checks that run on every node, the checks that run once in the flow process), each
    the selected checks of `config` in its part; `skip` and thresholds stay as they are."""
    names = [c.name for c in selected(config)]
    node = tuple(n for n in names if CHECKS.get(n).group in NODE_GROUPS)
    rest = tuple(n for n in names if n not in node)
    return config.model_copy(update={"checks": node}), config.model_copy(update={"checks": rest})


def python_of(launch: LaunchConfig) -> str:
    """The Python the nodes run: the one beside the recipe's torchrun (a venv's bin), else `python`
    on the nodes' PATH (after `launch.slurm.setup` activated an environment)."""
    torchrun = Path(launch.torchrun)
    return str(torchrun.with_name("python")) if "/" in launch.torchrun else "python"


def render_slurm(launch: LaunchConfig, config: PreflightConfig, out: Path, excluded: Sequence[str] = ()) -> str:
    """The sbatch script of the preflight job for a stage launched with `launch` (see the module
    docstring); it reads `{out}/launch/preflight-config.json` and `-facts.json`."""
    c, s = launch, launch.slurm
    out = Path(out).resolve()
    sb = sbatch_resources(c, f"{s.job_name}-preflight", c.nodes, JOB_TIME)
    if excluded:
        sb.append(("exclude", ",".join(excluded)))
    sb += [
        ("no-requeue", None),  # a preflight that lost a node has found what it looks for
        ("output", str(out / "launch" / "preflight-%j.log")),
        ("chdir", str(c.code_path)),
    ]
    sb += sorted(s.sbatch_args.items())
    lines = [
        "#!/bin/bash",
        "# A smollm3 preflight job rendered by infra/preflight/cluster.py: every node checks itself.",
        *(f"#SBATCH --{k}" + (f"={v}" if v is not None else "") for k, v in sb),
        "",
        *s.setup,  # the nodes' environment, as training gets it (module load, venv, limits)
        "set -uo pipefail",
        f'export PYTHONPATH={shlex.quote(str(c.code_path))}"${{PYTHONPATH:+:$PYTHONPATH}}"',
    ]
    env = {"OMP_NUM_THREADS": "1"} | launch_env(c.fabric, c.rendezvous, labels=False) | dict(c.env)
    lines += [f"export {k}={shlex.quote(v)}" for k, v in sorted(env.items())]
    launch_dir = out / "launch"
    node_check = shlex.join(
        [
            python_of(c),
            "-m",
            "infra.preflight",
            "--config",
            str(launch_dir / "preflight-config.json"),
            "--facts",
            str(launch_dir / "preflight-facts.json"),
        ]
    ) + (f' --node "$SLURMD_NODENAME" --json {shlex.quote(str(out / NODES_DIR))}/"$SLURMD_NODENAME".json')
    backend = "nccl" if c.gpus_per_node else "gloo"
    mib = config.nccl_mib if backend == "nccl" else config.gloo_mib
    timeout = int(config.collective_timeout_s)
    allreduce = [
        shlex.quote(c.torchrun),
        '--nnodes="$SLURM_JOB_NUM_NODES"',
        f"--nproc-per-node={c.procs_per_node}",
        "--rdzv-backend=c10d",
        f'--rdzv-endpoint="$MASTER_ADDR:{c.master_port or job_port()}"',  # its own job: its own port
        '--rdzv-id="preflight-$SLURM_JOB_ID"',
        "--max-restarts=0",
        f"-m infra.preflight.allreduce --backend {backend} --mib {mib:g} --iters {config.collective_iters}",
        f"--json {shlex.quote(str(out / ALLREDUCE_JSON))}",
    ]
    lines += [
        'echo "[preflight] job $SLURM_JOB_ID on $SLURM_JOB_NUM_NODES node(s) $SLURM_JOB_NODELIST"',
        "# every node checks itself; its report is written atomically, whole or not at all",
        "srun --ntasks-per-node=1 --kill-on-bad-exit=0 bash -c " + shlex.quote("exec " + node_check),
        'echo "[preflight] node checks ended with code $? (1: a node would stop training)"',
        "# then one all-reduce across every node's ranks: the bandwidth the training job will see",
        'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"timeout -k 10 {timeout} srun --ntasks-per-node=1 --kill-on-bad-exit=1 \\",
        "  " + " \\\n  ".join(allreduce),
        'echo "[preflight] all-reduce across the nodes ended with code $?"',
        "exit 0  # the verdict is in the reports, read by the preflight step",
        "",
    ]
    return "\n".join(lines)


@dataclass
class JobOutcome:
    """What a preflight job found: its job id, end state, the allocation's nodes, each node's
    results (None: it wrote no report) and the cross-node all-reduce record (None: none)."""

    job: str
    state: str
    nodes: list[str]
    results: dict[str, list[CheckResult] | None] = field(default_factory=dict)
    allreduce: dict | None = None
    log: Path | None = None

    def bad_nodes(self) -> dict[str, str]:
        """node -> why it must not train: its failed checks, or the report it never wrote. A
        warning (slow checkpoint storage, a throttled clock under load) stops the run unless
        `allow_warn`, as a local preflight does, but excludes no node: what warns on one node of a
        shared filesystem or a busy machine usually warns on every node."""
        bad = {}
        for node in self.nodes:
            found = self.results.get(node)
            if found is None:
                bad[node] = f"wrote no report (crashed, hung or was killed: see {self.log})"
            elif should_stop(found, allow_warn=True):
                bad[node] = "; ".join(
                    f"{r.name} {r.status.upper()} {r.value}".strip() for r in blocking(found, allow_warn=True)
                )
        return bad

    def rows(self, config: PreflightConfig) -> list[CheckResult]:
        """Every node's results as `check@node` rows, a `report@node` fail for a node without a
        report, and the `allreduce_nodes` row of the all-reduce across the allocation."""
        rows = []
        for node in self.nodes:
            found = self.results.get(node)
            if found is None:
                rows.append(CheckResult(f"report@{node}", "fail", advice=f"node wrote no report: see {self.log}"))
                continue
            rows += [CheckResult(**{**r.to_dict(), "name": f"{r.name}@{node}"}) for r in found]
        return [*rows, self._allreduce_row(config)]

    def slowest(self, check: str) -> float | None:
        """The lowest metric of `check` over the nodes (the slowest node paces every step)."""
        found = [r.metric for rs in self.results.values() for r in rs or () if r.name == check and r.status != "skip"]
        found = [m for m in found if m is not None]
        return min(found) if found else None

    def _allreduce_row(self, config: PreflightConfig) -> CheckResult:
        name = "allreduce_nodes"
        data = self.allreduce
        if data is None:
            return CheckResult(name, "fail", advice=f"the all-reduce across the nodes left no record: see {self.log}")
        if not data.get("correct", False):
            return CheckResult(name, "fail", value=json.dumps(data), advice="the all-reduce returned a wrong sum")
        world, busbw = int(data.get("world", 0)), float(data.get("busbw_gbps", 0.0))
        value = (
            f"{busbw:.2f} GB/s busbw ({float(data.get('algbw_gbps', 0.0)):.2f} algbw, {data.get('mib')} MiB, "
            f"{len(self.nodes)} node(s), {world} ranks, {data.get('backend')})"
        )
        if world < 2:
            return CheckResult(name, "skip", value=value, advice="one rank: no all-reduce to measure")
        floor = config.min_nccl_busbw_gbps if data.get("backend") == "nccl" else config.min_gloo_busbw_gbps
        threshold = f"busbw >= {floor:g} GB/s" if floor else "informational"
        if floor and busbw < floor:
            advice = "slow fabric between the nodes: check launch.fabric (EFA/InfiniBand settings) and NCCL_DEBUG=INFO"
            return CheckResult(name, "warn", value, threshold, advice, metric=busbw)
        return CheckResult(name, "pass", value, threshold, metric=busbw)


def _nodes_of(job: str, runner: Runner) -> list[str]:
    """The nodes of job `job`'s allocation, expanded (`scontrol show hostnames`); [] when Slurm
    no longer says."""
    proc = runner(["scontrol", "show", "job", "-o", job])
    found = re.search(r"(?:^|\s)NodeList=(\S+)", proc.stdout or "") if proc.returncode == 0 else None
    if not found or found.group(1) in ("(null)", "None"):
        return []
    names = runner(["scontrol", "show", "hostnames", found.group(1)])
    return (names.stdout or "").split() if names.returncode == 0 else []


def read_node_reports(out: Path) -> dict[str, list[CheckResult]]:
    """node -> its results, from the whole reports in `{out}/nodes/` (an unreadable one is left
    out: its node then counts as having written none)."""
    found = {}
    for path in sorted((Path(out) / NODES_DIR).glob("*.json")):
        report = read_json(path)
        try:
            node = str(report["node"])
            found[node] = [CheckResult(**r) for r in report["results"]]
        except (TypeError, KeyError, ValueError):
            continue
    return found


def run_preflight_job(
    launch: LaunchConfig,
    config: PreflightConfig,
    facts: PreflightFacts,
    out: Path,
    *,
    excluded: Sequence[str] = (),
    log: Callable[[str], object] = print,
    runner: Runner = _run,
    sleep: Callable[[float], None] = time.sleep,
) -> JobOutcome:
    """Submit the preflight job of `launch` (the node checks of `config` on every node), follow
    its log until it ends, and collect what every node of its allocation reported. Raises
    LaunchFailed when the job cannot be submitted; an interrupted wait cancels the job."""
    out = Path(out).resolve()
    launch_dir = out / "launch"
    write_json_atomic(launch_dir / "preflight-config.json", config.model_dump(mode="json"))
    write_json_atomic(launch_dir / "preflight-facts.json", facts.to_dict())
    script = render_slurm(launch, config, out, excluded)
    (launch_dir / "preflight.sbatch").write_text(script)  # for people to read; sbatch gets the bytes
    try:
        proc = runner(["sbatch", "--parsable"], input=script)
    except FileNotFoundError:
        raise LaunchFailed(
            "sbatch not found: launch.kind is slurm, so preflight runs as a Slurm job on the stage's nodes; run "
            "the flow on a login node (or a Prefect worker there), or use launch.kind local"
        ) from None
    job = (proc.stdout or "").strip().split(";")[0]
    if proc.returncode != 0 or not job.isdigit():
        raise LaunchFailed(
            f"submitting the preflight job ({launch_dir / 'preflight.sbatch'}) failed: sbatch exited "
            f"{proc.returncode}: {(proc.stderr or proc.stdout).strip()}"
        )
    logfile = launch_dir / f"preflight-{job}.log"
    log(f"[preflight] submitted Slurm job {job} on {launch.nodes} node(s); log {logfile}")
    slurm = SlurmLauncher(launch, runner, sleep)
    nodes: list[str] = []
    offset, tail = 0, collections.deque(maxlen=20)
    with following(f"preflight job {job}", lambda: runner(["scancel", job])) as handle:
        try:
            while True:
                try:
                    state, _ = slurm.state(job)
                except JobGone:
                    state = "GONE"
                if not nodes and state not in ("PENDING", "GONE"):
                    nodes = _nodes_of(job, runner)
                if logfile.exists():
                    with open(logfile, encoding="utf-8", errors="replace") as fh:
                        fh.seek(offset)
                        chunk, offset = fh.read(), fh.tell()
                    for line in chunk.splitlines():
                        tail.append(line)
                        log(line)
                if state in DONE or state in FAILED or state == "GONE":
                    break
                sleep(launch.slurm.poll_seconds)
                handle.check()
        except BaseException:
            runner(["scancel", job])  # a preflight is cheap to run again: never leave one behind
            raise
    reports = read_node_reports(out)
    nodes = nodes or _nodes_of(job, runner) or sorted(reports)
    log(f"[preflight] Slurm job {job} ended {state}; reports from {len(reports)} of {len(nodes)} node(s)")
    return JobOutcome(
        job=job,
        state=state,
        nodes=nodes,
        results={n: reports.get(n) for n in nodes},
        allreduce=read_json(out / ALLREDUCE_JSON),
        log=logfile,
    )
