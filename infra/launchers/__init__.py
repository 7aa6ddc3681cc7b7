"""Launchers for training stages: local torchrun (default), Slurm, Kubernetes (PyTorchJob).

    from infra.launchers import LauncherConfig, get_launcher
    get_launcher(LauncherConfig(kind="slurm", nodes=48, procs_per_node=8, gpus_per_node=8)).launch(
        spec_path, workdir, log)

Importing the package registers the built-in launchers; see `base.py` for the interface.
"""

from infra.launchers import kubernetes as _kubernetes  # noqa: F401  (registers "kubernetes")
from infra.launchers import local as _local  # noqa: F401  (registers "local")
from infra.launchers import slurm as _slurm  # noqa: F401  (registers "slurm")
from infra.launchers.base import (
    LAUNCHERS,
    KubernetesLaunch,
    Launcher,
    LauncherConfig,
    LaunchFailed,
    SlurmLaunch,
    get_launcher,
)

__all__ = [
    "LAUNCHERS",
    "KubernetesLaunch",
    "LaunchFailed",
    "Launcher",
    "LauncherConfig",
    "SlurmLaunch",
    "get_launcher",
]
