"""Supervised fine-tuning with TRL's `SFTTrainer`: chat messages, assistant-only loss, packing.

The conversations are rendered with our tokenizer's dual-mode chat template; its `{% generation %}`
markers give TRL the assistant-token mask, so only assistant turns (content and closing
`<|im_end|>`) carry loss (`assistant_only_loss=True`, as SmolLM3). Packing (best-fit decreasing,
whole conversations, position ids restart per conversation) fills every row of `max_length`.
The held-out conversations give an eval loss after training.

The step launches `train_sft` on the recipe's launcher (trainers/posttrain/launch.py); it resumes
from its newest checkpoint when a killed attempt left one.
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
from trainers.posttrain.sections import PosttrainSpec, SFTConfig


@step("sft", version=3, kind="hf_model", resource="train", resumable=True, **TRAINER_RETRIES)
def sft(
    config: PosttrainSpec[SFTConfig], model: Artifact, data: Artifact, *, out: Path, log=print, progress=None
) -> dict[str, Any]:
    """The base model (`model`) fine-tuned on the conversations (`data`), trained by
    a launched job (trainers/posttrain/launch.py)."""
    from pipeline.runner import flow_run_name

    return launch_trainer("sft", config, model_dir(model), data.path, out, log, progress, flow_run_name())
