"""Linear merges over safetensors: `merged = sum_i w_i * theta_i`, tensor by tensor, in float32,
saved in the first model's dtype.

Every model must have the same tensor names and shapes (same architecture and tokenizer); the
config, generation config and tokenizer are copied from the first model, so the merged model
keeps its chat template and stop tokens. The merge step is tasks/posttrain/merge.py.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_WEIGHT_FILES = (".safetensors", ".bin", ".pt")


def load_safetensors(folder: Path) -> dict[str, Any]:
    """Every tensor of the `.safetensors` shards in `folder`, by name."""
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
    shutil.copytree(
        folders[0],
        tmp,
        ignore=lambda _, names: [n for n in names if n.endswith(_WEIGHT_FILES) or n == "model.safetensors.index.json"],
    )
    save_file(merged, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return {"tensors": len(merged), "parameters": sum(t.numel() for t in merged.values())}
