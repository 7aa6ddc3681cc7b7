"""Shared fixtures for tests of `model/`: tiny configs and the repository root on sys.path."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # the package is not installed in the venv
    sys.path.insert(0, str(REPO_ROOT))

from model.config import ModelConfig  # noqa: E402
from tests.tasks.conftest import run_ws  # noqa: E402, F401  (fixture: a workspace mid-run)


@pytest.fixture(autouse=True)
def _two_threads():
    torch.set_num_threads(2)


@pytest.fixture
def tiny_cfg() -> ModelConfig:
    """4 layers (so layer 3 is NoPE), hidden 64, GQA 4:2, vocab 128."""
    return ModelConfig.tiny(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        max_seq_len=128,
    )


def write_two_source_plan(folder: Path, seq_len: int = 32, vocab_size: int = 128) -> Path:
    """Synthetic datatrove-layout shards for sources "prose" and "code" plus their plan JSON."""
    import json

    import numpy as np

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    sources = []
    for name, weight, low in (("prose", 0.7, 1), ("code", 0.3, 64)):
        docs = [rng.integers(low, low + 60, rng.integers(5, 60)).tolist() + [0] for _ in range(80)]
        flat = np.array([t for d in docs for t in d], dtype="<u2")
        path = folder / f"000_{name}.ds"
        flat.tofile(path)
        np.cumsum([len(d) for d in docs]).astype("<u8").tofile(str(path) + ".index")
        sources.append(
            {
                "name": name,
                "weight": weight,
                "files": [str(path)],
                "available_tokens": len(flat),
                "budget_tokens": 4000,
                "expected_epochs": 1.0,
            }
        )
    plan = {
        "stage": "stage1",
        "seed": 0,
        "seq_len": seq_len,
        "tokens": 8000,
        "vocab_size": vocab_size,
        "eos_id": 0,
        "token_dtype": "uint16",
        "sources": sources,
    }
    (folder / "plan.json").write_text(json.dumps(plan))
    return folder / "plan.json"


@pytest.fixture
def plan_path(tmp_path) -> Path:
    return write_two_source_plan(tmp_path / "shards")
