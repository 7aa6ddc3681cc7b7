"""Tests for model/recompute.py: activation checkpointing changes memory, never the math.

Every mode trains the same steps from the same weights on CPU fp32; losses, gradients and final
weights must be bit-identical to no checkpointing (recomputation replays the same ops on the same
inputs). The memory each mode keeps after the forward is measured with torch's MemTracker.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

from model.model import SmolLM3
from model.optim import build_optimizer
from model.spec import OptimizerConfig


def _train(cfg, mode: str, steps: int = 4, doc_masking: bool = True, fused_qkv: bool = False):
    torch.manual_seed(0)
    model = SmolLM3(cfg)
    model.init_weights(seed=0)
    model.set_activation_checkpointing(mode)
    model.set_fused_qkv(fused_qkv)
    opt = build_optimizer(model, OptimizerConfig(lr=3e-3))
    gen = torch.Generator().manual_seed(1)
    losses, grads = [], []
    for _ in range(steps):
        ids = torch.randint(0, cfg.vocab_size, (2, 32), generator=gen)
        docs = (torch.arange(32) * 3 // 32).expand(2, 32) if doc_masking else None
        loss = model(ids, docs, ids.roll(-1, 1)).loss
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, grads, model.state_dict()


@pytest.mark.parametrize(
    ("mode", "doc_masking", "fused_qkv"),
    [(m, d, False) for m in ("selective", "full") for d in (True, False)]
    + [("selective", True, True), ("full", True, True)],
)
def test_checkpointing_is_bit_identical_to_none_on_cpu_fp32(tiny_cfg, mode, doc_masking, fused_qkv):
    torch.use_deterministic_algorithms(True)
    try:
        want_losses, want_grads, want_weights = _train(tiny_cfg, "none", doc_masking=doc_masking, fused_qkv=fused_qkv)
        got_losses, got_grads, got_weights = _train(tiny_cfg, mode, doc_masking=doc_masking, fused_qkv=fused_qkv)
    finally:
        torch.use_deterministic_algorithms(False)
    assert got_losses == want_losses  # exact floats, not approximately
    for want, got in zip(want_grads, got_grads, strict=True):
        for name in want:
            assert torch.equal(got[name], want[name]), f"{mode}: gradient of {name} differs"
    for name in want_weights:
        assert torch.equal(got_weights[name], want_weights[name]), f"{mode}: weight {name} differs"


def _activation_bytes_after_forward(cfg, mode: str) -> int:
    torch.manual_seed(0)
    model = SmolLM3(cfg)
    model.set_activation_checkpointing(mode)
    ids = torch.randint(0, cfg.vocab_size, (2, 64))
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        loss = model(ids, None, ids).loss
        current = tracker.get_tracker_snapshot("current")
        loss.backward()
    return current[torch.device("cpu")][_MemRefType.ACT]


def test_each_mode_keeps_less_than_the_one_before(tiny_cfg):
    cfg = tiny_cfg.replace(hidden_size=128, intermediate_size=512, num_heads=4, num_kv_heads=2)
    kept = {mode: _activation_bytes_after_forward(cfg, mode) for mode in ("none", "selective", "full")}
    assert kept["none"] > kept["selective"] > kept["full"], kept
    # full keeps one (B, T, H) fp32 input per block, plus the loss's stored gradients and the final
    # norm: far below a tenth of what none keeps at this shape.
    assert kept["full"] < kept["none"] / 4, kept


def test_unknown_mode_is_refused_with_the_choices(tiny_cfg):
    with pytest.raises(ValueError, match="none, selective, full"):
        SmolLM3(tiny_cfg).set_activation_checkpointing("partial")
