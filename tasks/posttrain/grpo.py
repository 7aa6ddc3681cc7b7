"""RL with verifiable rewards: TRL's `GRPOTrainer` on arithmetic prompts.

Rewards: exact match of the final `Answer: N` against the known answer (1/0) plus a weighted
format reward (a worked solution ending in `Answer: N`), so early policies that never hit the
answer still get a gradient towards the right shape. Each prompt gets `num_generations`
completions whose rewards are normalised within the group; `beta` is the KL penalty to the
starting policy.

The step launches `train_grpo` on the recipe's launcher (trainers/posttrain/launch.py) and is
resumable like every post-training step: the trainer checkpoints every `save_steps` into
`{step folder}/checkpoints/step_N` (trainers/posttrain/common.py); after a crash the rerun (same
fingerprint, folder kept by `resumable=True`) resumes from the newest verified checkpoint
(weights, optimizer, scheduler, RNG, data position) instead of starting over.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.artifact import Artifact
from pipeline.step import step
from trainers.posttrain.common import (
    model_dir,
)
from trainers.posttrain.launch import TRAINER_RETRIES, launch_trainer
from trainers.posttrain.sections import GRPOConfig, PosttrainSpec


@step("grpo", version=3, kind="hf_model", resumable=True, resource="train", **TRAINER_RETRIES)
def grpo(
    config: PosttrainSpec[GRPOConfig], model: Artifact, data: Artifact, *, out: Path, log=print, progress=None
) -> dict[str, Any]:
    """The policy (`model`) trained with GRPO on the prompts of `data` by a launched
    job (trainers/posttrain/launch.py); resumes."""
    from pipeline.runner import flow_run_name

    return launch_trainer("grpo", config, model_dir(model), data.path, out, log, progress, flow_run_name())
