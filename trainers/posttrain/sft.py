"""Supervised fine-tuning with TRL's `SFTTrainer`: chat messages, assistant-only loss, packing.

The conversations are rendered with our tokenizer's dual-mode chat template; its `{% generation %}`
markers give TRL the assistant-token mask, so only assistant turns (content and closing
`<|im_end|>`) carry loss (`assistant_only_loss=True`, as SmolLM3). Packing (best-fit decreasing,
whole conversations, position ids restart per conversation) fills every row of `max_length`.
The held-out conversations give an eval loss after training.

The step launches `train_sft` on the recipe's launcher (trainers/posttrain/launch.py); it resumes
from its newest checkpoint when a killed attempt left one.

Runs on every rank of a launch (`python -m trainers.posttrain`); the `sft` step
(tasks/posttrain/sft.py) launches it.
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
from trainers.posttrain.sections import SFTConfig


@plain_print()
def train_sft(
    cfg: SFTConfig,
    base: Path,
    data: Path,
    out: Path,
    seed: int = 0,
    device: str = "auto",
    log: Callable[[str], None] = print,
    progress: Callable[[float], None] | None = None,
    callbacks: Sequence[Any] = (),
) -> dict[str, Any]:
    """Fine-tune the model in `base` on `data/train.jsonl` (resuming from a checkpoint in `out`);
    write `out/model`; return the meta."""
    import trl  # trl.SFTConfig, not ours (trainers/posttrain/sections.py)
    from datasets import Dataset

    started = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load_policy(base, cfg.bf16)
    train = Dataset.from_list([{"messages": r["messages"]} for r in read_jsonl(data / "train.jsonl")])
    heldout_rows = read_jsonl(data / "heldout.jsonl")
    heldout = Dataset.from_list([{"messages": r["messages"]} for r in heldout_rows]) if heldout_rows else None
    common = trainer_args(cfg, out, seed, device)
    args = trl.SFTConfig(
        **common,
        max_length=cfg.max_length,
        packing=cfg.packing,
        assistant_only_loss=cfg.assistant_only_loss,
        per_device_eval_batch_size=common["per_device_train_batch_size"],
        eval_strategy="no",
    )
    trainer = trl.SFTTrainer(
        model=model,
        args=args,
        train_dataset=train,
        eval_dataset=heldout,
        processing_class=tokenizer,
        callbacks=[progress_callback(progress, log, out), checkpoint_callback(out, cfg.keep_checkpoints), *callbacks],
    )
    quiet(trainer)
    resumed = fit(trainer, out, log, "sft")
    facts = write_history(trainer, out)
    if heldout is not None:
        facts["eval_loss"] = round(float(trainer.evaluate()["eval_loss"]), 5)
    folder = save_policy(trainer, tokenizer, out / "model")
    log(
        f"sft: {facts['steps']} steps, loss {facts['first_loss']} -> {facts['last_loss']}, "
        f"held-out loss {facts.get('eval_loss')}"
    )
    return model_meta("sft", folder, started, examples=len(train), resumed_from_step=resumed, **facts)
