"""Host checks: the open-file limit a rank can reach and the host memory a node can give, against
what the stage plan says training needs (model/host_memory.py: loader, checkpoint staging, the
rank processes; the facts `open_files` and `host_memory_gb`).

Both read the process they run in, so on a cluster they mean something only where training runs:
the preflight job runs them on every node of the allocation (infra/preflight/cluster.py), under
the limits the job's shell set (`ulimit` lines of `launch.slurm.setup`, srun's propagated limits).
Without the fact (0: a local launch, where the trainer is this machine's child) they skip.
"""

from __future__ import annotations

import os
import resource
from pathlib import Path

from infra.preflight.core import Check, CheckContext, CheckResult, register


def _limit(n: int) -> str:
    return "unlimited" if n == resource.RLIM_INFINITY else str(n)


@register
class OpenFiles(Check):
    """The open-file limit (RLIMIT_NOFILE) a rank can raise itself to, against what it opens."""

    name, group, order = "open_files", "host", 65

    def run(self, ctx: CheckContext) -> CheckResult:
        need = ctx.facts.open_files
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        value = f"soft {_limit(soft)}, hard {_limit(hard)}"
        if not need:
            return self.skip(f"{value}; the open files a rank needs are not known (fact open_files)")
        reach = float("inf") if hard == resource.RLIM_INFINITY else hard
        threshold = f"hard >= {need} (data shards, libraries, sockets, checkpoint files per rank)"
        if reach < need:
            return self.result(
                "fail",
                value,
                threshold,
                f"the job's `ulimit -n {need}` cannot pass the hard limit {hard}: raise the node's limit "
                "(limits.conf, slurmd's LimitNOFILE) or lower training.loader.open_shards",
                metric=float(hard),
            )
        note = "" if soft == resource.RLIM_INFINITY or soft >= need else f"; the job raises the soft limit to {need}"
        return self.result("pass", value, threshold + note, metric=reach)


def _meminfo_gb(field: str) -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024 / 1e9
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_limit_gb() -> float | None:
    """The memory limit of this process's cgroup (v2 `memory.max`, v1 `memory.limit_in_bytes`)."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            raw = Path(path).read_text().strip()
        except OSError:
            continue
        if raw.isdigit() and int(raw) < 1 << 60:  # "max" or a page-rounded 2^63: no limit
            return int(raw) / 1e9
    return None


def memory_sources() -> dict[str, float]:
    """What bounds this process's host memory, in GB: the node's available memory, its cgroup's
    limit, and under Slurm the job's allocation (`SLURM_MEM_PER_NODE`, MB)."""
    found = {"MemAvailable": _meminfo_gb("MemAvailable"), "cgroup limit": _cgroup_limit_gb()}
    slurm = os.environ.get("SLURM_MEM_PER_NODE", "")
    if slurm.isdigit() and int(slurm) > 0:
        found["Slurm --mem"] = int(slurm) * 2**20 / 1e9
    return {k: v for k, v in found.items() if v is not None}


@register
class HostMemory(Check):
    """Host memory this node can give training (available, cgroup, Slurm allocation) against the
    stage plan's per-node need."""

    name, group, order = "host_memory", "host", 66

    def run(self, ctx: CheckContext) -> CheckResult:
        need = ctx.facts.host_memory_gb
        sources = memory_sources()
        if not sources:
            return self.skip("cannot read /proc/meminfo: not a Linux host")
        bound, gb = min(sources.items(), key=lambda kv: kv[1])
        value = f"{gb:.1f} GB ({bound}; " + ", ".join(f"{k} {v:.1f}" for k, v in sources.items()) + ")"
        if not need:
            return self.skip(f"{value}; the node's need is not known (fact host_memory_gb)")
        threshold = f">= {need:g} GB per node (loader, checkpoint staging, rank processes)"
        if gb < need:
            return self.result(
                "fail",
                value,
                threshold,
                f"{bound} leaves {gb:.1f} GB of the {need:g} GB the stage plan needs: free the node, ask "
                "for more (launch.slurm.mem) or lower training.loader.prefetch / use async_checkpoint=false",
                metric=gb,
            )
        return self.result("pass", value, threshold, metric=gb)
