"""Single-rollout asynchronous RL (SAO) beside GRPO: the same prompts and verifiable rewards, one
completion per prompt from separate rollout processes, bounded staleness with AReaL's decoupled
PPO correction, and a value model as the baseline (trainers/posttrain/sao.py).

The step launches `train_sao` on the recipe's launcher (trainers/posttrain/launch.py) with one
rank: the trainer is one process, and it starts its rollout workers itself. Resumable like every
post-training step: checkpoints (policy, value model, optimizers, policy version, queue position)
every `save_steps`; a rerun resumes from the newest verified one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.artifact import Artifact
from pipeline.step import step
from trainers.posttrain.common import model_dir
from trainers.posttrain.launch import TRAINER_RETRIES, launch_trainer
from trainers.posttrain.sections import PosttrainSpec, SAOConfig


@step("sao", version=1, kind="hf_model", resumable=True, resource="train", **TRAINER_RETRIES)
def sao(
    config: PosttrainSpec[SAOConfig], model: Artifact, data: Artifact, *, out: Path, log=print, progress=None
) -> dict[str, Any]:
    """The policy (`model`) trained with SAO on the prompts of `data` by a launched job
    (trainers/posttrain/launch.py); resumes."""
    from pipeline.runner import flow_run_name

    if config.world_size != 1:
        raise ValueError(
            f"sao: the trainer runs as one rank, its launch has {config.world_size} "
            "(the flow gives the sao step a one-rank launch)"
        )
    return launch_trainer("sao", config, model_dir(model), data.path, out, log, progress, flow_run_name())
