"""A tiny trainer stage for launcher tests: synthetic token shards, a mixture plan and a spec.

The spec trains a 4-layer, 64-wide model for a few steps on CPU (seconds), so launchers can be
tested end to end with the real `python -m trainers.pretrain` rather than a stand-in.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.model.conftest import write_two_source_plan

TINY_MODEL = {"hidden_size": 64, "intermediate_size": 128, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2}


def write_plan(folder: Path, seq_len: int = 32) -> Path:
    """Two synthetic sources in datatrove's `.ds` / `.ds.index` layout plus their plan JSON."""
    return write_two_source_plan(folder, seq_len=seq_len)


def write_spec(path: Path, plan: Path, out: Path, **kw) -> Path:
    spec = {
        "mixture_plan": str(plan),
        "out_dir": str(out),
        "steps": 2,
        "global_batch": 4,
        "micro_batch": 2,
        "model_overrides": TINY_MODEL,
        "optimizer": {"lr": 3e-3},
        "schedule": {"warmup_steps": 1, "decay_fraction": 0.5, "total_steps": 4},
        "checkpoint_interval": 2,
        "keep_last": 2,
        "num_threads": 1,
        "peak_flops": 1e10,
        "device": "cpu",
    } | kw
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(spec))
    return path
