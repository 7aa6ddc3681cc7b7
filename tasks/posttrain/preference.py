"""Preference optimisation with TRL's `DPOTrainer` (APO-zero by default, as SmolLM3).

Pairs come from a dataset (`pairs: files:...|hf:...`, rows of prompt/chosen/rejected) or, with
`pairs: self`, from the SFT model's own samples judged by the arithmetic verifier: for each
prompt the policy samples `samples_per_prompt` answers; an incorrect one is the rejected
completion; the chosen one is a correct sample when the policy produced one, else the reference
worked solution (at tiny scale the policy is rarely right, so the reference keeps the signal;
SmolLM3 took chosen answers from a stronger model, which the reference stands in for). Prompts
whose samples are all correct give no pair. The SFT model is the frozen reference.

Pairs are made once, by the main rank, before training (the others wait, then read them), and
kept in `pairs.jsonl`: every rank trains on the same pairs whatever the world size, and a resumed
run trains on the pairs of the run it continues. The step launches `train_preference` on the
recipe's launcher (trainers/posttrain/launch.py); it resumes from its newest checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.artifact import Artifact
from pipeline.step import step
from trainers.posttrain.chat_data import data_state
from trainers.posttrain.common import (
    model_dir,
)
from trainers.posttrain.launch import TRAINER_RETRIES, launch_trainer
from trainers.posttrain.sections import PosttrainSpec, PreferenceConfig


@step(
    "preference",
    version=3,
    kind="hf_model",
    resource="train",
    resumable=True,
    extra=lambda run: data_state(run.section.pairs),
    **TRAINER_RETRIES,
)
def preference(
    config: PosttrainSpec[PreferenceConfig], model: Artifact, data: Artifact, *, out: Path, log=print, progress=None
) -> dict[str, Any]:
    """The SFT model (`model`) preference-optimised on pairs (from `data` or the
    recipe), trained by a launched job (trainers/posttrain/launch.py)."""
    from pipeline.runner import flow_run_name

    return launch_trainer("preference", config, model_dir(model), data.path, out, log, progress, flow_run_name())
