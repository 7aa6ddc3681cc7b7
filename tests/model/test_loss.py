"""Tests for model/loss.py: the chunked linear cross-entropy against the unfused oracle.

Equality: loss, hidden-state gradient and head gradient within fp32 tolerance of
`F.cross_entropy(F.linear(h, W).float(), y)` (ignored targets, z-loss, chunk sizes that do and do
not divide the tokens, one chunk, CPU bf16 autocast). Memory: measured with torch's MemTracker
during forward and backward, the chunked loss's peak is bounded by the chunk (plus the two stored
gradients), while the oracle's grows with tokens x vocabulary.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

from model.loss import IGNORE_INDEX, linear_cross_entropy, reference_cross_entropy


def _inputs(n=300, hidden=48, vocab=257, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(2, n // 2, hidden, generator=gen, dtype=dtype)
    w = torch.randn(vocab, hidden, generator=gen, dtype=dtype) * 0.2
    y = torch.randint(0, vocab, (2, n // 2), generator=gen)
    y[0, :7] = IGNORE_INDEX
    y[1, -3:] = IGNORE_INDEX
    return h, w, y


def _loss_and_grads(fn, h, w, y, **kw):
    h = h.clone().requires_grad_(True)
    w = w.clone().requires_grad_(True)
    loss = fn(h, w, y, **kw)
    (loss * 0.37).backward()  # a non-unit incoming gradient (gradient accumulation scales it)
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("chunk", [1, 64, 150, 1000])
@pytest.mark.parametrize("z_loss", [0.0, 1e-3])
def test_equals_the_unfused_loss_and_gradients_in_fp32(chunk, z_loss):
    h, w, y = _inputs()
    want = _loss_and_grads(reference_cross_entropy, h, w, y, z_loss=z_loss)
    got = _loss_and_grads(linear_cross_entropy, h, w, y, chunk_tokens=chunk, z_loss=z_loss)
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-7)


def test_under_cpu_bf16_autocast_it_matches_the_unfused_path_under_autocast():
    h, w, y = _inputs(n=256, hidden=64, vocab=512)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = _loss_and_grads(reference_cross_entropy, h, w, y)
        got = _loss_and_grads(linear_cross_entropy, h, w, y, chunk_tokens=96)
    assert got[1].dtype == want[1].dtype == torch.float32  # gradients in the inputs' dtype
    torch.testing.assert_close(got[0], want[0], rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(got[1], want[1], rtol=2e-2, atol=2e-4)
    torch.testing.assert_close(got[2], want[2], rtol=2e-2, atol=2e-4)


def test_without_grad_it_only_computes_the_loss():
    h, w, y = _inputs()
    with torch.no_grad():
        got = linear_cross_entropy(h, w, y, chunk_tokens=50)
    torch.testing.assert_close(got, reference_cross_entropy(h, w, y), rtol=1e-6, atol=1e-6)


def test_a_second_backward_is_refused():
    h, w, y = _inputs()
    h.requires_grad_(True)
    loss = linear_cross_entropy(h, w, y)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward"):
        loss.backward()


def _peak_bytes(fn, n, hidden, vocab, **kw) -> int:
    h, w, y = _inputs(n=n, hidden=hidden, vocab=vocab)
    tracker = MemTracker()
    h.requires_grad_(True)
    w.requires_grad_(True)
    tracker.track_external(h, w, y)
    with tracker:
        fn(h, w, y, **kw).backward()
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def test_peak_memory_is_bounded_by_the_chunk_not_by_tokens_times_vocabulary():
    hidden, vocab, chunk = 64, 8192, 128
    inputs = lambda n: (n * hidden + vocab * hidden) * 4 + n * 8  # noqa: E731  h, w (fp32), labels (int64)
    stored = lambda n: (n * hidden + vocab * hidden) * 4  # noqa: E731  the gradients kept for backward
    for n in (1024, 4096):
        got = _peak_bytes(linear_cross_entropy, n, hidden, vocab, chunk_tokens=chunk)
        # Beyond inputs and stored gradients, one chunk's fp32 logits buffer (the softmax and its
        # gradient are built in place in it) and a few per-row vectors: no term in n x vocab.
        bound = inputs(n) + stored(n) + chunk * vocab * 4 * 1.05 + 64 * n
        assert got <= bound, (n, got, bound)
        oracle = _peak_bytes(reference_cross_entropy, n, hidden, vocab)
        assert oracle >= inputs(n) + 2 * n * vocab * 4, (n, oracle)  # logits + their gradient
    # 4x the tokens: the chunked peak grows by the token-sized tensors only.
    small = _peak_bytes(linear_cross_entropy, 1024, hidden, vocab, chunk_tokens=chunk)
    large = _peak_bytes(linear_cross_entropy, 4096, hidden, vocab, chunk_tokens=chunk)
    assert large - small < 3 * 3072 * hidden * 4 + 64 * 3072, (small, large)
