"""Linear merge of models over safetensors (SmolLM3: 0.9 x APO soup + 0.1 x mid-training).

`merged = sum_i w_i * theta_i`, tensor by tensor, in float32, saved in the first model's dtype.
Every model must have the same tensor names and shapes (same architecture and tokenizer); the
config, generation config and tokenizer are copied from the first (post-trained) model, so the
merged model keeps its chat template and stop tokens. Small and dependency-free: MergeKit adds
TIES/DARE/SLERP, which the published recipe does not use.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from infra.artifact import Artifact, Inputs
from tasks.posttrain.common import model_dir
from tasks.posttrain.config import MergeSection
from tasks.step import many, step

_WEIGHT_FILES = (".safetensors", ".bin", ".pt")


def load_safetensors(folder: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    shards = sorted(Path(folder).glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"merge: {folder} holds no .safetensors weights")
    tensors: dict[str, Any] = {}
    for shard in shards:
        tensors |= load_file(str(shard))
    return tensors


def linear_merge(folders: Sequence[Path], weights: Sequence[float], out: Path) -> dict[str, Any]:
    """Write the weighted sum of the models in `folders` to `out`; return counts."""
    import torch
    from safetensors.torch import save_file

    if len(folders) != len(weights):
        raise ValueError(f"merge: {len(folders)} models but {len(weights)} weights ({list(weights)})")
    states = [load_safetensors(f) for f in folders]
    first = states[0]
    for folder, state in zip(folders[1:], states[1:], strict=True):
        if set(state) != set(first):
            diff = sorted(set(state) ^ set(first))[:5]
            raise ValueError(f"merge: {folder} has different tensors than {folders[0]} (e.g. {diff})")
        bad = [k for k in first if state[k].shape != first[k].shape]
        if bad:
            raise ValueError(
                f"merge: {folder} tensor {bad[0]} has shape {tuple(state[bad[0]].shape)}, "
                f"{folders[0]} has {tuple(first[bad[0]].shape)}: not the same architecture"
            )
    merged = {}
    for name, tensor in first.items():
        acc = torch.zeros(tensor.shape, dtype=torch.float32)
        for w, state in zip(weights, states, strict=True):
            acc += w * state[name].float()
        merged[name] = acc.to(tensor.dtype).contiguous()
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    shutil.copytree(folders[0], tmp, ignore=lambda _, names: [n for n in names if n.endswith(_WEIGHT_FILES)
                                                               or n == "model.safetensors.index.json"])
    save_file(merged, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return {"tensors": len(merged), "parameters": sum(t.numel() for t in merged.values())}


def build_merge(cfg: MergeSection, models: Sequence[Artifact], out: Path, log=print) -> dict[str, Any]:
    started = time.monotonic()
    folders = [model_dir(m) for m in models]
    facts = linear_merge(folders, cfg.weights, out / "model")
    parts = " + ".join(f"{w} x {m.meta.get('stage', m.short)}" for w, m in zip(cfg.weights, models, strict=True))
    log(f"merge: {parts} ({facts['tensors']} tensors)")
    return {"stage": "merge", "kind": "posttrain", "model_dir": str(out / "model"),
            "parameters": facts["parameters"], "weights": list(cfg.weights),
            "merged": [m.meta.get("stage", m.short) for m in models],
            "seconds": round(time.monotonic() - started, 1)}


@step("merge", version=2, kind="hf_model", resource="eval", isolate=True)
def merge(config: MergeSection, inputs: Inputs, out: Path, *, log=print) -> dict[str, Any]:
    """A linear merge of the models of input `models` (post-trained first, then the base)."""
    return build_merge(config, many(inputs, "models"), out, log)
