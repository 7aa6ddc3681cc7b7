"""What a multi-node launch tells NCCL, torchrun and the ranks: fabric, timeouts, signals, log labels.

The recipe's `launch.fabric` and `launch.rendezvous` sections, rendered the same way by every
launcher (Slurm's sbatch script, the Kubernetes PyTorchJob, local torchrun):

- fabric environment (`fabric_env`): NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME for the bootstrap
  and TCP interfaces; InfiniBand/RoCE (`NCCL_IB_HCA`, `NCCL_IB_GID_INDEX`, `NCCL_IB_TIMEOUT`,
  `NCCL_IB_RETRY_CNT`) or AWS EFA through libfabric (`FI_PROVIDER=efa`,
  `FI_EFA_USE_DEVICE_RDMA=1`, `FI_EFA_FORK_SAFE=1`; needs the aws-ofi-nccl plugin in the image);
  always NCCL error handling on (`TORCH_NCCL_ASYNC_ERROR_HANDLING=3`: a failed or timed-out
  collective ends the rank instead of hanging it, torch's default since 2.2, said explicitly),
  the NCCL watchdog's heartbeat timeout (`TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC`) and the collective
  timeout the trainer gives `init_process_group` (`SMOLLM3_COLLECTIVE_TIMEOUT_S`). `launch.env`
  entries override any of these.
- torchrun (`torchrun_flags`, `launch_env`): the c10d rendezvous timeouts (`--rdzv-conf`: how
  long the first node waits for the last, how long a store read may take), the stop signals
  torchrun forwards to the ranks (SIGUSR1 besides its default SIGTERM/SIGINT/SIGHUP/SIGQUIT) and
  how long it then waits for them to save a checkpoint (`--shutdown-timeout`, trainers/rank_signals.py;
  set through the environment, which `accelerate launch` honours too), and rank-labelled output:
  every line a rank prints reaches the job log as `[rank17]: ...` (torchrun `--tee` with a
  log-line prefix), the full per-rank logs under the stage's `logs/ranks/`.

Defaults are what an HPC engineer would start from on a healthy cluster; every value is a recipe
field with its unit in the name. See docs/scale.md, "Fabric and timeouts".
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

COLLECTIVE_TIMEOUT_ENV = "SMOLLM3_COLLECTIVE_TIMEOUT_S"  # read by trainers/pretrain.py setup_runtime
RANK_LABEL = "[rank${rank}]: "  # torchrun's log-line prefix template: the global rank
STOP_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"  # torchrun's defaults plus Slurm's warning


class FabricConfig(BaseModel):
    """The recipe's `launch.fabric`: the interconnect and NCCL's error handling."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["ethernet", "infiniband", "efa"] = "ethernet"  # the GPU-to-GPU network between nodes
    socket_ifname: str | None = None  # NCCL/GLOO_SOCKET_IFNAME: interfaces for bootstrap/TCP ("ens", "^lo,docker")
    ib_hca: str | None = None  # infiniband: NCCL_IB_HCA, the adapters to use ("mlx5", "=mlx5_0:1,mlx5_1:1")
    ib_gid_index: int | None = Field(default=None, ge=0)  # infiniband over RoCE: NCCL_IB_GID_INDEX (often 3)
    ib_timeout: int = Field(default=22, ge=1, le=31)  # infiniband: NCCL_IB_TIMEOUT, 4.096 us x 2^N per retry
    ib_retry_count: int = Field(default=7, ge=0, le=7)  # infiniband: NCCL_IB_RETRY_CNT before an error
    efa_device_rdma: bool = True  # efa: FI_EFA_USE_DEVICE_RDMA (p4d/p5 instances support it)
    nccl_debug: Literal["VERSION", "WARN", "INFO"] = "WARN"  # NCCL_DEBUG: WARN names the failing peer
    async_error_handling: Literal[1, 2, 3] = 3  # TORCH_NCCL_ASYNC_ERROR_HANDLING: 3 = end the rank, no abort
    heartbeat_timeout_s: int = Field(default=600, gt=0)  # TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC: a stuck watchdog
    collective_timeout_s: int = Field(default=1800, gt=0)  # a collective waiting longer is an error


class RendezvousConfig(BaseModel):
    """The recipe's `launch.rendezvous`: how torchrun's c10d rendezvous waits, and stops."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    join_timeout_s: int = Field(default=900, gt=0)  # the first node waits this long for the last one
    last_call_timeout_s: int = Field(default=30, gt=0)  # after the minimum joined, wait for stragglers
    close_timeout_s: int = Field(default=60, gt=0)  # a closed rendezvous is seen by every node within this
    read_timeout_s: int = Field(default=120, gt=0)  # a c10d store read (a busy node 0) may take this long
    stop_grace_s: int = Field(default=180, gt=0)  # after a stop signal, ranks get this long to save; then SIGKILL
    label_ranks: bool = True  # prefix every rank's line with `[rankN]: ` (per-rank logs under logs/ranks/)


def fabric_env(fabric: FabricConfig) -> dict[str, str]:
    """The environment of every node's torchrun (gloo ignores the NCCL settings on CPU)."""
    env = {COLLECTIVE_TIMEOUT_ENV: str(fabric.collective_timeout_s)}
    if fabric.socket_ifname:
        env["GLOO_SOCKET_IFNAME"] = fabric.socket_ifname
    env |= {
        "NCCL_DEBUG": fabric.nccl_debug,
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": str(fabric.async_error_handling),
        "TORCH_NCCL_ENABLE_MONITORING": "1",
        "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": str(fabric.heartbeat_timeout_s),
    }
    if fabric.socket_ifname:
        env["NCCL_SOCKET_IFNAME"] = fabric.socket_ifname
    if fabric.kind == "infiniband":
        env |= {"NCCL_IB_TIMEOUT": str(fabric.ib_timeout), "NCCL_IB_RETRY_CNT": str(fabric.ib_retry_count)}
        if fabric.ib_hca:
            env["NCCL_IB_HCA"] = fabric.ib_hca
        if fabric.ib_gid_index is not None:
            env["NCCL_IB_GID_INDEX"] = str(fabric.ib_gid_index)
    elif fabric.kind == "efa":
        env |= {"FI_PROVIDER": "efa", "FI_EFA_FORK_SAFE": "1"}
        if fabric.efa_device_rdma:
            env["FI_EFA_USE_DEVICE_RDMA"] = "1"
    return env


def rdzv_conf(rdzv: RendezvousConfig) -> str:
    """torchrun's `--rdzv-conf` value for the c10d backend."""
    return (
        f"join_timeout={rdzv.join_timeout_s},last_call_timeout={rdzv.last_call_timeout_s},"
        f"close_timeout={rdzv.close_timeout_s},read_timeout={rdzv.read_timeout_s}"
    )


def torchrun_flags(rdzv: RendezvousConfig, log_dir: Path | str | None, *, rendezvous: bool = True) -> list[str]:
    """torchrun flags of multi-node launches: the c10d rendezvous timeouts, and rank labels with
    the per-rank logs in `log_dir` (torchrun prefixes only the lines it tees from those files)."""
    flags = [f"--rdzv-conf={rdzv_conf(rdzv)}"] if rendezvous else []
    if rdzv.label_ranks and log_dir is not None:
        flags += ["--tee=3", f"--log-dir={log_dir}"]
    return flags


def launch_env(fabric: FabricConfig, rdzv: RendezvousConfig, *, labels: bool) -> dict[str, str]:
    """The environment every node's torchrun (or `accelerate launch`, which runs torchrun's
    code) starts with: the fabric's, the stop signals it forwards to the ranks and how long it
    then waits for them (both read by torchrun from the environment, so accelerate gets them
    too), and with `labels` the rank-label template (read from the environment only)."""
    env = fabric_env(fabric) | {
        "PET_SIGNALS_TO_HANDLE": STOP_SIGNALS,  # torchrun's --signals-to-handle
        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(rdzv.stop_grace_s),  # torchrun's --shutdown-timeout
    }
    if labels and rdzv.label_ranks:
        env["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] = RANK_LABEL
    return env
