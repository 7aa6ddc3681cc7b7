"""The model card (`README.md`) of an exported Hugging Face folder: what the model is and where it
came from, so a folder copied out of the workspace still says so.

It holds what the export step knows when it writes the folder: the architecture and size, the
stage that trained it (kind, steps, sequence length, tokens, final loss, the learning-rate
schedule), the tokens it drew per source (the data), the checkpoint it was exported from and
its lineage fingerprint, and how to find its evaluations in lineage (they run after the export).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def model_card(
    *,
    stage_meta: dict[str, Any],
    spec: dict[str, Any] | None,
    architecture: dict[str, Any],
    checkpoint_fingerprint: str,
    export_id: str,
    parameters: int,
    dtype: str,
) -> str:
    """The card's markdown, from the trained stage's artifact meta, its `spec.json` (optimizer
    and schedule) and the model's architecture (ModelConfig as a dict)."""
    stage = stage_meta.get("stage", "?")
    optimizer = (spec or {}).get("optimizer") or {}
    schedule = (spec or {}).get("schedule") or {}
    arch = ", ".join(
        f"{k} {architecture[k]}"
        for k in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "vocab_size", "rope_theta")
        if k in architecture
    )
    loss = stage_meta.get("final_loss")
    lines = [
        "---",
        "library_name: transformers",
        "tags: [smollm3-pipeline, smollm3]",
        "---",
        "",
        f"# SmolLM3-style model: stage `{stage}`",
        "",
        f"A `SmolLM3ForCausalLM` ({parameters:,} parameters, {dtype} weights) trained by smollm3-pipeline "
        "and exported at the end of a training stage. It loads with "
        "`AutoModelForCausalLM.from_pretrained(this_folder)`; the tokenizer beside it carries the run's chat template.",
        "",
        "## Training",
        "",
        f"- stage: `{stage}` ({stage_meta.get('kind') or 'pretrain'}), {stage_meta.get('steps', '?')} steps at "
        f"sequence length {stage_meta.get('seq_len', '?')}, {_tokens(stage_meta.get('tokens'))} tokens",
        f"- final training loss: {loss:.4f}"
        if isinstance(loss, int | float)
        else "- final training loss: not recorded",
    ]
    if arch:
        lines.append(f"- architecture: {arch}")
    if optimizer:
        lines.append(
            f"- optimizer: AdamW, lr {optimizer.get('lr')}, betas {optimizer.get('betas')}, "
            f"weight decay {optimizer.get('weight_decay')}, gradient clip {optimizer.get('grad_clip')}"
        )
    if schedule:
        lines.append(f"- schedule: {json.dumps(schedule, sort_keys=True)}")
    if stage_meta.get("init_from"):
        lines.append("- initialised from the previous stage's checkpoint (or a pinned base)")
    per_source = stage_meta.get("tokens_per_source") or {}
    lines += ["", "## Data", ""]
    if per_source:
        total = sum(per_source.values()) or 1
        lines += ["| source | tokens drawn in this stage | share |", "|---|---|---|"]
        lines += [f"| {s} | {n:,} | {n / total:.1%} |" for s, n in sorted(per_source.items(), key=lambda kv: -kv[1])]
    else:
        lines.append("The stage recorded no per-source token counts.")
    lines += [
        "",
        "## Lineage",
        "",
        f"- checkpoint fingerprint: `{checkpoint_fingerprint}`",
        f"- export step folder: `export/{export_id}`",
        "- every step that led here, with its config: `smollm3 lineage <this folder>` in the workspace",
        "- its evaluations (they run after the export): `smollm3 lineage <this folder> --descendants`",
        "",
    ]
    return "\n".join(lines)


def _tokens(n: Any) -> str:
    return f"{n:,}" if isinstance(n, int) else "?"


def read_spec(checkpoint_folder: Path) -> dict[str, Any] | None:
    """The stage's `spec.json` beside its checkpoints, or None when it is not readable here."""
    try:
        return json.loads((checkpoint_folder / "spec.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
