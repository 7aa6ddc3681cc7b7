"""Linear merges over safetensors, the SmolLM3 way: a soup of preference-trained models, then
0.9 x that soup + 0.1 x a mid-training (here: long-context) checkpoint.

One step, two uses in the DAG (flows/smollm3.py `post_train`): `merge[soup]` averages the
preference runs (`posttrain.merge.soup`, weights `soup_weights` or uniform) and `merge[merge]`
merges the soup (or the single preference model) with the export of `posttrain.merge.stage`
(weights `posttrain.merge.weights`). Every ingredient is a named input (`models`, in weight
order), so lineage lists each one; the meta lists them with their weights.

`merged = sum_i w_i * theta_i`, tensor by tensor, in float32, saved in the first model's dtype.
Every model must have the same tensor names and shapes (same architecture and tokenizer); the
config, generation config and tokenizer are copied from the first (post-trained) model, so the
merged model keeps its chat template and stop tokens. Small and dependency-free: MergeKit adds
TIES/DARE/SLERP, which the published recipe does not use.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from model.merging import linear_merge
from pipeline.artifact import Artifact
from pipeline.step import step
from trainers.posttrain.common import model_dir
from trainers.posttrain.sections import MergeSpec


def _name(model: Artifact) -> str:
    """How an ingredient is called in logs: its stage, and seed/beta when a soup has several."""
    name = str(model.meta.get("stage", model.short))
    extra = [f"{k} {model.meta[k]}" for k in ("seed", "beta") if k in model.meta]
    return f"{name} ({', '.join(extra)})" if extra else name


@step("merge", version=3, kind="hf_model", resource="eval", isolate=True)
def merge(config: MergeSpec, models: tuple[Artifact, ...], *, out: Path, log=print) -> dict[str, Any]:
    """The weighted sum of the `models` (weights in the same order)."""
    started = time.monotonic()
    if len(models) != len(config.weights):
        raise ValueError(
            f"merge: input `models` has {len(models)} models but the config has "
            f"{len(config.weights)} weights ({list(config.weights)})"
        )
    folders = [model_dir(m) for m in models]
    facts = linear_merge(folders, config.weights, out / "model")
    names = [_name(m) for m in models]
    log(
        "merge: "
        + " + ".join(f"{w} x {n}" for w, n in zip(config.weights, names, strict=True))
        + f" ({facts['tensors']} tensors)"
    )
    return {
        "stage": "merge",
        "kind": "posttrain",
        "model_dir": str(out / "model"),
        "parameters": facts["parameters"],
        "weights": list(config.weights),
        "merged": names,
        "ingredients": [
            {
                "fingerprint": m.fingerprint,
                "stage": m.meta.get("stage"),
                "weight": w,
                **{k: m.meta[k] for k in ("seed", "beta", "loss_type") if k in m.meta},
            }
            for m, w in zip(models, config.weights, strict=True)
        ],
        "seconds": round(time.monotonic() - started, 1),
    }
