"""Supervised fine-tuning with TRL's `SFTTrainer`: chat messages, assistant-only loss, packing.

The conversations are rendered with our tokenizer's ChatML template; its `{% generation %}`
markers give TRL the assistant-token mask, so only assistant turns (content and closing
`<|im_end|>`) carry loss (`assistant_only_loss=True`, as SmolLM3). Packing (best-fit decreasing,
whole conversations, position ids restart per conversation) fills every row of `max_length`.
The held-out conversations give an eval loss after training.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from infra.artifact import Inputs
from tasks.posttrain.common import (
    load_policy,
    model_dir,
    model_meta,
    plain_print,
    progress_callback,
    quiet,
    save_policy,
    trainer_args,
    write_history,
)
from tasks.posttrain.config import SFTSection, TrainerRun
from tasks.posttrain.data import read_jsonl
from tasks.step import one, step


@plain_print()
def train_sft(
    cfg: SFTSection, base: Path, data: Path, out: Path, seed: int = 0, device: str = "auto",
    log: Callable[[str], None] = print, progress: Callable[[float], None] | None = None,
) -> dict[str, Any]:
    """Fine-tune the model in `base` on `data/train.jsonl`; write `out/model`; return the meta."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    started = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load_policy(base, cfg.bf16)
    train = Dataset.from_list([{"messages": r["messages"]} for r in read_jsonl(data / "train.jsonl")])
    heldout_rows = read_jsonl(data / "heldout.jsonl")
    heldout = Dataset.from_list([{"messages": r["messages"]} for r in heldout_rows]) if heldout_rows else None
    args = SFTConfig(
        **trainer_args(cfg, out / "trainer", seed, device),
        max_length=cfg.max_length,
        packing=cfg.packing,
        assistant_only_loss=cfg.assistant_only_loss,
        per_device_eval_batch_size=cfg.per_device_batch,
        eval_strategy="no",
    )
    trainer = SFTTrainer(
        model=model, args=args, train_dataset=train, eval_dataset=heldout,
        processing_class=tokenizer, callbacks=[progress_callback(progress, log)],
    )
    quiet(trainer)
    trainer.train()
    facts = write_history(trainer, out)
    if heldout is not None:
        facts["eval_loss"] = round(float(trainer.evaluate()["eval_loss"]), 5)
    folder = save_policy(trainer, tokenizer, out / "model")
    log(f"sft: {facts['steps']} steps, loss {facts['first_loss']} -> {facts['last_loss']}, "
        f"held-out loss {facts.get('eval_loss')}")
    return model_meta("sft", folder, model, started, examples=len(train), **facts)


@step("sft", version=2, kind="hf_model", resource="train", isolate=True)
def sft(config: TrainerRun[SFTSection], inputs: Inputs, out: Path, *, log=print, progress=None) -> dict[str, Any]:
    """The base model (input `model`) fine-tuned on the conversations (input `data`)."""
    return train_sft(config.section, model_dir(one(inputs, "model")), one(inputs, "data").path, out,
                     config.seed, config.device, log, progress)
