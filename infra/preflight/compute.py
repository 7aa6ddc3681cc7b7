"""CPU-side measurements that run on any machine: fp32 matmul GFLOP/s and a gloo all-reduce.

They are the preflight of the `tiny` recipe on a laptop and a sanity floor on a GPU node (a starved
CPU slows data loading and the launch). Both are informational unless a threshold is set.
"""

from __future__ import annotations

import time

from infra.preflight.collective import run_allreduce
from infra.preflight.core import Check, CheckContext, CheckResult, register


def cpu_matmul_gflops(n: int, seconds: float, burst: float = 0.05, rounds: int = 3, pause: float = 0.2) -> float:
    """fp32 n x n matmul GFLOP/s on this process's torch threads: the best burst of about `burst`
    seconds over `rounds` measurements of `seconds / rounds` each, `pause` seconds apart. The
    trainer's MFU peak on CPU is this figure (tasks/preflight.py stores it): a mean would measure
    the neighbours' load (a shared machine, data steps beside preflight) and read low, and MFU
    against it high; rounds apart give a passing load spike less chance to cover the whole
    measurement. A peak that still reads below what training achieves is reported as wrong by the
    trainer, never as an MFU above 100%."""
    import torch

    a = torch.randn(n, n)  # (n, n) fp32
    b = torch.randn(n, n)
    c = torch.empty(n, n)
    torch.mm(a, b, out=c)  # warm up
    best = 0.0
    for r in range(rounds):
        if r:
            time.sleep(pause)
        deadline = time.perf_counter() + seconds / rounds
        while True:
            count, start = 0, time.perf_counter()
            while True:
                torch.mm(a, b, out=c)
                count += 1
                elapsed = time.perf_counter() - start
                if elapsed >= burst:
                    break
            best = max(best, 2.0 * n**3 * count / elapsed / 1e9)
            if time.perf_counter() >= deadline:
                break
    return best


@register
class CpuMatmul(Check):
    """fp32 matmul GFLOP/s on this process's CPU threads (best burst)."""

    name, group, order = "cpu_matmul", "compute", 60

    def run(self, ctx: CheckContext) -> CheckResult:
        import torch

        c = ctx.config
        rate = cpu_matmul_gflops(c.cpu_matmul_size, c.cpu_matmul_seconds)
        value = (
            f"{rate:.1f} GFLOP/s fp32 ({c.cpu_matmul_size}^2, {torch.get_num_threads()} threads, "
            "best burst of 3 rounds)"
        )
        return self.result("pass", value, "informational", metric=rate)


@register
class GlooAllReduce(Check):
    """All-reduce bus bandwidth between local CPU ranks (torchrun, gloo). A recipe that trains
    one rank per node has no collective between local ranks: the check skips (it would start
    torchrun and two ranks, each importing torch, for a figure the run never depends on) unless
    `checks` names it."""

    name, group, order = "gloo_allreduce", "compute", 61

    def run(self, ctx: CheckContext) -> CheckResult:
        c = ctx.config
        if ctx.facts.nproc_per_node < 2 and self.name not in (c.checks or ()):
            return self.skip("one rank per node (nproc_per_node 1): no all-reduce between local ranks to measure")
        res = run_allreduce(ctx.commands, "gloo", c.gloo_ranks, c.gloo_mib, c.collective_iters, c.collective_timeout_s)
        if res.error:
            return self.result(
                "fail",
                "",
                "",
                f"gloo all-reduce over {c.gloo_ranks} ranks failed: {res.error}; check that "
                "localhost resolves and that GLOO_SOCKET_IFNAME (if set) names an interface",
            )
        value = f"{res.busbw_gbps:.2f} GB/s busbw ({res.algbw_gbps:.2f} algbw, {c.gloo_mib:g} MiB, {res.world} ranks)"
        if c.min_gloo_busbw_gbps and res.busbw_gbps < c.min_gloo_busbw_gbps:
            return self.result(
                "warn",
                value,
                f">= {c.min_gloo_busbw_gbps:g} GB/s",
                "slow CPU collectives: other jobs on the node, or a slow loopback",
                metric=res.busbw_gbps,
            )
        threshold = f">= {c.min_gloo_busbw_gbps:g} GB/s" if c.min_gloo_busbw_gbps else "informational"
        return self.result("pass", value, threshold, metric=res.busbw_gbps)
