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
