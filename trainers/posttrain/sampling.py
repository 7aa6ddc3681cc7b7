"""Answers from a chat model to chat prompts in one reasoning mode: batched, left-padded, greedy
(temperature 0) or seeded sampling, decoded with the think block kept.

Used by the preference_pairs step (tasks/posttrain/preference_pairs.py) for the policy and for a
named chosen or rejected model. The prompt is rendered by the model's own chat template with
`enable_thinking` set from the mode (SmolLM3's and Qwen3's templates read it; our pairs' prompts
also carry the mode in their system turn), so a no-think answer follows the template's empty
`<think></think>` block and a think answer opens its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def load_chat_model(name: str, device: str, bf16: bool = False):
    """(model, tokenizer) of a local HF folder or a hub model, ready for batched generation."""
    from trainers.posttrain.common import load_policy

    if Path(name).expanduser().is_dir():
        model, tokenizer = load_policy(Path(name).expanduser(), bf16)
    else:  # a hub model (needs network and, for Qwen3-32B, a large GPU)
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(name)
        if tokenizer.chat_template is None:
            raise ValueError(f"pair source model:{name} has no chat template; name an instruct/chat model")
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16 if bf16 else torch.float32)
    return model.to(device), tokenizer


def chat_answers(
    model,
    tokenizer,
    prompts: list[list[dict[str, Any]]],
    mode: str,
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    batch_size: int = 16,
    offset: int = 0,
) -> list[str]:
    """One answer per chat prompt, in `mode` (think / no_think). `offset`: the position of
    `prompts[0]` in the whole prompt list, for the seeds (`generate_left_padded`)."""

    texts = [
        tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True, enable_thinking=mode == "think")
        for p in prompts
    ]
    sample = temperature > 0
    extra = {"temperature": temperature, "top_k": 0, "top_p": 1.0} if sample else {}
    answers = generate_left_padded(
        model,
        tokenizer,
        texts,
        batch_size,
        seed=seed,
        offset=offset,
        do_sample=sample,
        max_new_tokens=max_new_tokens,
        **extra,
    )
    return [a.strip() for a in answers]


def generate_left_padded(
    model, tokenizer, texts: list[str], batch_size: int, *, seed: int | None = None, offset: int = 0, **generate
) -> list[str]:
    """The new text of each rendered prompt in `texts`: left-padded batches of `batch_size`,
    `model.generate(**generate)` with the model's end-of-turn ids, special tokens dropped. With
    `seed`, each batch reseeds to `seed + offset + its first index` (its draws depend on the seed
    and its position only: `texts` cut into pieces of whole batches, each given its `offset` in
    the whole list, draw what the whole list draws); without, the caller's generator state runs on."""
    import torch

    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    out: list[str] = []
    model.eval()
    try:
        for i in range(0, len(texts), batch_size):
            if seed is not None:
                torch.manual_seed(seed + offset + i)
            enc = tokenizer(texts[i : i + batch_size], return_tensors="pt", padding=True, add_special_tokens=False)
            enc = enc.to(model.device)
            with torch.no_grad():
                gen = model.generate(
                    **enc,
                    eos_token_id=model.generation_config.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id,
                    **generate,
                )
            out += tokenizer.batch_decode(gen[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    finally:
        tokenizer.padding_side = side
    return out
