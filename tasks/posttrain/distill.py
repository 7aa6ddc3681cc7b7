"""On-policy distillation (OPD): the student samples, the teacher scores every visited state.

TRL's `DistillationTrainer` generates completions from the student for each prompt, then
minimises a generalised Jensen-Shannon divergence between the student's and the teacher's
next-token distributions at every generated position (`beta` = 1.0 is the reverse KL of
on-policy distillation; 0.0 the forward KL). This is GKD with lmbda = 1 (all data on-policy).
The step runs only when the recipe names `posttrain.distill.teacher`: a local HF folder or hub
name whose tokenizer matches ours (same vocabulary: the divergence compares distributions over
the same token ids). The step launches `train_distill` on the recipe's launcher
(trainers/posttrain/launch.py); it resumes from its newest checkpoint.
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
from trainers.posttrain.sections import DistillConfig, PosttrainSpec


def teacher_state(run: PosttrainSpec[DistillConfig]) -> str:
    """The teacher's weights are outside the config: a changed local teacher reruns the step."""
    import hashlib

    config = run.section
    if not config.teacher or not Path(config.teacher).expanduser().is_dir():
        return config.teacher or ""
    h = hashlib.sha256()
    for f in sorted(Path(config.teacher).expanduser().glob("*.safetensors")):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


@step("distill", version=3, kind="hf_model", resource="train", resumable=True, extra=teacher_state, **TRAINER_RETRIES)
def distill(
    config: PosttrainSpec[DistillConfig], model: Artifact, data: Artifact, *, out: Path, log=print, progress=None
) -> dict[str, Any]:
    """The student (`model`) distilled on-policy from the recipe's teacher on `data`,
    by a launched job (trainers/posttrain/launch.py)."""
    from pipeline.runner import flow_run_name

    return launch_trainer("distill", config, model_dir(model), data.path, out, log, progress, flow_run_name())
