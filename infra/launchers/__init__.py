"""Launchers for training stages: local torchrun (default), Slurm, Kubernetes (PyTorchJob).

    from infra.launchers import LaunchConfig, get_launcher
    get_launcher(LaunchConfig(kind="slurm", nodes=48, procs_per_node=8, gpus_per_node=8)).launch(
        spec_path, workdir, log)

Importing the package registers the built-in launchers; see `base.py` for the interface.
"""

from infra.launchers import kubernetes as _kubernetes  # noqa: F401  (registers "kubernetes")
from infra.launchers import local as _local  # noqa: F401  (registers "local")
from infra.launchers import slurm as _slurm  # noqa: F401  (registers "slurm")
from infra.launchers.base import (
    LAUNCHERS,
    HostNeeds,
    KubernetesLaunchConfig,
    LaunchConfig,
    Launcher,
    LaunchFailed,
    SlurmLaunchConfig,
    get_launcher,
)

__all__ = [
    "LAUNCHERS",
    "HostNeeds",
    "KubernetesLaunchConfig",
    "LaunchFailed",
    "Launcher",
    "LaunchConfig",
    "SlurmLaunchConfig",
    "get_launcher",
]
