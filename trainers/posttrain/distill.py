"""On-policy distillation (OPD): the student samples, the teacher scores every visited state.

TRL's `DistillationTrainer` generates completions from the student for each prompt, then
minimises a generalised Jensen-Shannon divergence between the student's and the teacher's
next-token distributions at every generated position (`beta` = 1.0 is the reverse KL of
on-policy distillation; 0.0 the forward KL). This is GKD with lmbda = 1 (all data on-policy).
The step runs only when the recipe names `posttrain.distill.teacher`: a local HF folder or hub
name whose tokenizer matches ours (same vocabulary: the divergence compares distributions over
the same token ids). The step launches `train_distill` on the recipe's launcher
(trainers/posttrain/launch.py); it resumes from its newest checkpoint.

Runs on every rank of a launch (`python -m trainers.posttrain`); the `distill` step
(tasks/posttrain/distill.py) launches it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from trainers.posttrain.chat_data import read_jsonl
from trainers.posttrain.common import (
    checkpoint_callback,
    fit,
    load_policy,
    model_meta,
    plain_print,
    progress_callback,
    quiet,
    save_policy,
    trainer_args,
    write_history,
)
from trainers.posttrain.sections import DistillConfig


def check_teacher(teacher, student, teacher_name: str, teacher_tok=None, student_tok=None) -> None:
    """The divergence compares distributions over token ids: same size and, when the teacher
    ships a tokenizer, the same token for every id."""
    tv, sv = teacher.config.vocab_size, student.config.vocab_size
    same = tv == sv and (teacher_tok is None or teacher_tok.get_vocab() == student_tok.get_vocab())
    if not same:
        raise ValueError(
            f"posttrain.distill.teacher {teacher_name!r} has a different vocabulary (size {tv}, the "
            f"student {sv}): on-policy distillation needs a teacher with the same tokenizer"
        )


@plain_print()
def train_distill(
    cfg: DistillConfig,
    student: Path,
    data: Path,
    out: Path,
    seed: int = 0,
    device: str = "auto",
    log: Callable[[str], None] = print,
    progress: Callable[[float], None] | None = None,
    callbacks: Sequence[Any] = (),
) -> dict[str, Any]:
    """Distil `cfg.teacher` into the model in `student` on-policy (resuming from a checkpoint in
    `out`); write `out/model`."""
    import torch
    import trl  # trl.DistillationConfig, not ours (trainers/posttrain/sections.py)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    if not cfg.teacher:
        raise ValueError("posttrain.distill.teacher is not set: name a teacher model folder")
    started = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load_policy(student, cfg.bf16)
    teacher_path = Path(cfg.teacher).expanduser()
    teacher = AutoModelForCausalLM.from_pretrained(
        str(teacher_path) if teacher_path.exists() else cfg.teacher,
        dtype=torch.bfloat16 if cfg.bf16 else torch.float32,
    )
    teacher_tok = None
    if teacher_path.is_dir() and (teacher_path / "tokenizer.json").is_file():
        from transformers import AutoTokenizer

        teacher_tok = AutoTokenizer.from_pretrained(str(teacher_path))
    check_teacher(teacher, model, cfg.teacher, teacher_tok, tokenizer)
    prompts = [{"prompt": r["prompt"]} for r in read_jsonl(data / "prompts.jsonl")]
    args = trl.DistillationConfig(
        **trainer_args(cfg, out, seed, device),
        beta=cfg.beta,
        max_completion_length=cfg.max_completion_length,
        temperature=cfg.temperature,
    )
    trainer = trl.DistillationTrainer(
        model=model,
        teacher_model=teacher,
        args=args,
        train_dataset=Dataset.from_list(prompts),
        processing_class=tokenizer,
        callbacks=[progress_callback(progress, log, out), checkpoint_callback(out, cfg.keep_checkpoints), *callbacks],
    )
    quiet(trainer)
    resumed = fit(trainer, out, log, "distill")
    facts = write_history(trainer, out)
    folder = save_policy(trainer, tokenizer, out / "model")
    log(f"distill from {cfg.teacher}: {facts['steps']} steps, divergence {facts['first_loss']} -> {facts['last_loss']}")
    return model_meta("opd", folder, started, teacher=cfg.teacher, beta=cfg.beta, resumed_from_step=resumed, **facts)
