"""Export a stage's final checkpoint to a Hugging Face folder: the format of every stage boundary.

The folder (`model/` in the step folder) is a `SmolLM3ForCausalLM` `save_pretrained` export with
safetensors weights and the run's tokenizer (with its dual-mode think / no-think chat template),
so lm-eval's `hf` model, TRL and serving stacks load it with `from_pretrained`; its
`generation_config.json` stops generation at `<|im_end|>` (the end of an assistant turn) as well
as at `<|endoftext|>`; its `README.md` is the model card
(model/model_card.py: architecture, the stage's training and data, lineage fingerprints).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from curation.bpe import tokenizer_folder
from infra.files import write_atomic
from pipeline.artifact import Artifact
from pipeline.step import step


class ExportConfig(BaseModel):
    """The recipe's `export` section."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    dtype: Literal["float32", "bfloat16"] = "float32"  # weights dtype of the exported folder


@step("export", version=2, kind="hf_model", resource="eval", isolate=True, retries=1)
def export(config: ExportConfig, checkpoint: Artifact, tokenizer: Artifact, *, out: Path, log=print) -> dict[str, Any]:
    """A stage's `checkpoint` and the run's `tokenizer` (the fertility decision or the tokenizer)
    to an HF folder."""
    import torch

    from model.checkpoint import load_model
    from model.hf import export_hf
    from model.model_card import model_card, read_spec

    tok_dir, eos_id = tokenizer_folder(tokenizer)
    model = load_model(checkpoint.meta["checkpoint"])
    folder = export_hf(
        model, out / "model", tokenizer_dir=tok_dir, eos_token_id=eos_id, dtype=getattr(torch, config.dtype)
    )
    n = sum(p.numel() for p in model.parameters())
    card = model_card(
        stage_meta=checkpoint.meta,
        spec=read_spec(checkpoint.path),
        architecture=dataclasses.asdict(model.config),
        checkpoint_fingerprint=checkpoint.fingerprint,
        export_id=out.name,
        parameters=n,
        dtype=config.dtype,
    )
    write_atomic(folder / "README.md", card)  # the model card: what it is and where it came from
    log(f"exported {checkpoint.meta['stage']} ({n:,} parameters) to {folder}")
    return {
        "stage": checkpoint.meta["stage"],
        "kind": checkpoint.meta.get("kind"),
        "model_dir": str(folder),
        "parameters": n,
        "dtype": config.dtype,
    }
